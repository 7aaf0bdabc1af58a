"""The Q4_1 layer: GGUF's blocks read exactly, the dense bf16 model's numbers, batch-invariant outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from diffdraft.fused_projections import ProjectionSlice, fuse_projections
from diffdraft.quantized.block_linear import DENSE_ROWS, BlockQuantizedLinear, BlockWeight

from conftest import needs_block_kernel, q4_1_blocks, q4_1_target


def _weight(rows: int, inputs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_blocks_dequantize_exactly_as_gguf_does():
    raw = quants.quantize(_weight(24, 96).numpy(), GGMLQuantizationType.Q4_1)
    expected = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    blocks = BlockWeight.from_gguf(raw)
    assert (blocks.out_features, blocks.in_features) == (24, 96)
    assert np.array_equal(blocks.dequantize().numpy(), expected)


def test_rows_and_stack_move_whole_rows():
    a, b = q4_1_blocks(_weight(8, 64, seed=1)), q4_1_blocks(_weight(4, 64, seed=2))
    order = torch.tensor([3, 0, 7, 1])
    assert torch.equal(a.rows(order).dequantize(), a.dequantize()[order])
    assert torch.equal(BlockWeight.stack([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


@needs_block_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "inputs"), [(1, 32), (5, 64), (37, 96), (64, 128)])
def test_outputs_are_the_dense_bf16_matmul_up_to_the_order_of_sums(rows, inputs, bias):
    blocks = q4_1_blocks(_weight(rows, inputs))
    layer = BlockQuantizedLinear(blocks, torch.randn(rows) if bias else None)
    x = torch.randn(2, 23, inputs).to(torch.bfloat16)
    dense = blocks.dequantize().to(torch.bfloat16).float()  # the weights a dense bf16 model holds
    expected = x.float() @ dense.T + (layer.bias.float() if bias else 0)
    out = layer(x)
    assert out.shape == (2, 23, rows) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3)


@needs_block_kernel
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 17, 40])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(rows):
    layer = BlockQuantizedLinear(q4_1_blocks(_weight(70, 192)))
    x = torch.randn(rows, 192).to(torch.bfloat16)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


@needs_block_kernel
def test_wrong_inputs_are_refused_with_the_reason():
    layer = BlockQuantizedLinear(q4_1_blocks(_weight(8, 64)))
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        layer(torch.randn(2, 96).to(torch.bfloat16))


@needs_block_kernel
def test_state_dict_holds_the_dense_weight():
    blocks = q4_1_blocks(_weight(8, 64))
    layer = BlockQuantizedLinear(blocks)
    state = layer.state_dict()
    assert torch.equal(state["weight"], blocks.dequantize().to(torch.bfloat16))


@needs_block_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stacked_siblings_give_each_its_own_columns(family):
    model, _ = q4_1_target(family)
    x = torch.randn(1, 5, model.config.hidden_size).to(torch.bfloat16)
    attention = model.model.layers[0].self_attn
    separate = [getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")]
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers
    assert isinstance(attention.q_proj, ProjectionSlice)
    assert isinstance(attention.q_proj.stacked.linear, BlockQuantizedLinear)
    for name, expected in zip(("q_proj", "k_proj", "v_proj"), separate, strict=True):
        assert torch.equal(getattr(attention, name)(x), expected)


@needs_block_kernel
def test_siblings_of_different_kinds_are_not_stacked():
    model, _ = q4_1_target("llama", layers=1)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = nn.Linear(64, 128, bias=False).to(torch.bfloat16)
    fuse_projections(model)
    assert isinstance(mlp.gate_proj, BlockQuantizedLinear)


@needs_block_kernel
def test_a_prefill_sized_call_runs_on_a_dense_copy_of_the_same_weights():
    blocks = q4_1_blocks(_weight(48, 64))
    layer = BlockQuantizedLinear(blocks)
    x = torch.randn(DENSE_ROWS, 64).to(torch.bfloat16)
    out = layer(x)
    assert layer._dense and torch.equal(layer._dense[0].weight, blocks.dequantize().to(torch.bfloat16))
    torch.testing.assert_close(out[:5].float(), layer(x[:5]).float(), rtol=2**-7, atol=1e-3)
    assert set(layer.state_dict()) == {"weight"}
