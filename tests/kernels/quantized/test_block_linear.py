"""The block layers: GGUF's Q4_1 and Q8_0 blocks read exactly; the int8 kernel computes llama.cpp's
int8 math and the bf16 one the dense bf16 model's numbers; both batch-invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from diffdraft.kernels.fused_projections import ProjectionSlice, fuse_projections
from diffdraft.kernels.quantized.block_linear import (
    ACTIVATIONS,
    DENSE_ROWS,
    BlockQuantizedLinear,
    BlockWeight,
    Q8Weight,
    kernel_rows_only,
    q4_1_linear,
)
from diffdraft.kernels.quantized.gguf_blocks import GGUFBlocks
from diffdraft.kernels.quantized.tile_layout import INT8_FORMATS

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import int8_rounded_inputs, q4_1_blocks, q4_1_target, random_gguf_bytes


def _weight(rows: int, inputs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)) * 0.05


def _blocks(format: str, rows: int, inputs: int) -> BlockWeight | Q8Weight | GGUFBlocks:
    if format == "Q4_1":
        return q4_1_blocks(_weight(rows, inputs))
    if format == "Q8_0":
        return _blocks_of(_weight(rows, inputs))
    return GGUFBlocks.from_gguf(random_gguf_bytes(format, rows, inputs), format)


def _blocks_of(weight: torch.Tensor) -> Q8Weight:
    return Q8Weight.from_gguf(quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0))


def _int8_reference(x: torch.Tensor, blocks: BlockWeight | Q8Weight) -> torch.Tensor:
    """The int8 kernel's math, simply, in float64: each row's blocks of 32 quantized to int8 by
    round(x * 127 / max|x|) in float32 (the kernel's codes exactly), then per block
    d_w * d_x * sum(code_w * code_x), plus m_w * d_x * sum(code_x) for Q4_1's offsets."""
    codes_x, scale_x = int8_rounded_inputs(x)
    if isinstance(blocks, Q8Weight):
        codes_w = blocks.codes.view(blocks.out_features, -1, 32).double()
    else:
        packed = blocks.codes.view(blocks.out_features, -1, 16).to(torch.int16)
        codes_w = torch.cat([packed & 15, packed >> 4], dim=-1).double()  # [out, blocks, 32]
    sums = torch.einsum("rbk,obk->rob", codes_x, codes_w)
    scale = (blocks.scales[None] * scale_x.float()[:, None]).double()  # d_w * d_x, rounded to float32
    out = (sums * scale).sum(-1)
    if isinstance(blocks, BlockWeight):
        sum_x = scale_x.float() * codes_x.sum(-1).float()  # s_x, rounded to float32 as the kernel keeps it
        out += (blocks.offsets.double()[None] * sum_x.double()[:, None]).sum(-1)
    return out


@pytest.mark.parametrize(
    ("kind", "weight_class"),
    [(GGMLQuantizationType.Q4_1, BlockWeight), (GGMLQuantizationType.Q8_0, Q8Weight)],
)
def test_blocks_dequantize_exactly_as_gguf_does(kind, weight_class):
    raw = quants.quantize(_weight(24, 96).numpy(), kind)
    expected = quants.dequantize(raw, kind)
    blocks = weight_class.from_gguf(raw)
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
def test_bf16_outputs_are_the_dense_bf16_matmul_up_to_the_order_of_sums(rows, inputs, bias):
    blocks = q4_1_blocks(_weight(rows, inputs))
    layer = BlockQuantizedLinear(blocks, torch.randn(rows) if bias else None, activations="bf16")
    x = torch.randn(2, 23, inputs).to(torch.bfloat16)
    dense = blocks.dequantize().to(torch.bfloat16).float()  # the weights a dense bf16 model holds
    expected = x.float() @ dense.T + (layer.bias.float() if bias else 0)
    out = layer(x)
    assert out.shape == (2, 23, rows) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3)


@needs_block_kernel
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "inputs"), [(1, 32), (5, 64), (37, 96), (64, 128), (200, 576)])
def test_int8_outputs_are_the_int8_math_and_near_the_dense_matmul(rows, inputs, bias, format):
    torch.manual_seed(rows)  # fixed data: a one-column layer's worst output sat past 2% in ~1 run of 10
    blocks = _blocks(format, rows, inputs)
    layer = BlockQuantizedLinear(blocks, torch.randn(rows) if bias else None)
    x = torch.randn(2, 23, inputs).to(torch.bfloat16)
    x[0, 3, :32] = 0  # an all-zero block has scale 0
    x[1, 4, 5] = 8.0  # an outlier coarsens only its own block
    out = layer(x)
    assert out.shape == (2, 23, rows) and out.dtype == torch.bfloat16
    added = layer.bias.double() if bias else 0
    same_math = _int8_reference(x, blocks).view(2, 23, rows) + added
    torch.testing.assert_close(out.double(), same_math, rtol=2**-8, atol=1e-5)
    dense = x.double() @ blocks.dequantize().double().T + added
    assert (out.double() - dense).abs().max() < 0.02 * dense.abs().max()


@needs_block_kernel
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_sums_stay_exact_where_every_product_is_at_its_largest(format, sign):
    """Largest codes times inputs of code +-127 everywhere: the AVX2 build sums Q4_1's products in
    16-bit lanes, which must not saturate (any lost bit shows against the reference)."""
    weight = torch.ones(48, 64)
    weight[:, ::32] = 0 if format == "Q4_1" else -1  # Q4_1: codes 0 and 15; Q8_0: -127 and 127
    blocks = q4_1_blocks(weight) if format == "Q4_1" else _blocks_of(weight)
    layer = BlockQuantizedLinear(blocks, None)
    x = torch.full((13, 64), sign, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x).double(), _int8_reference(x, blocks), rtol=2**-8, atol=0)


@needs_block_kernel
@pytest.mark.parametrize(
    ("format", "activations"),
    [("Q4_1", "bf16"), *((format, "int8") for format in INT8_FORMATS)],
)
def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_threads(format, activations):
    layer = BlockQuantizedLinear(_blocks(format, 70, 256), activations=activations)
    x = torch.randn(40, 256).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            for rows in [*range(2, 18), 40]:
                assert torch.equal(layer(x[:rows]), alone[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@needs_block_kernel
def test_many_rows_take_the_dense_copy_except_where_only_the_kernel_may_run():
    """A prefill's rows go dense; a verification of many trees at once must not, or its tokens would
    round unlike their decode steps."""
    layer = BlockQuantizedLinear(_blocks("Q4_1", 48, 64))
    x = torch.randn(DENSE_ROWS + 8, 64).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    with kernel_rows_only():
        assert torch.equal(layer(x), alone)
    assert not torch.equal(layer(x), alone)  # the dense copy rounds differently


@needs_block_kernel
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_wrong_inputs_are_refused_with_the_reason(activations):
    layer = BlockQuantizedLinear(q4_1_blocks(_weight(8, 64)), activations=activations)
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        layer(torch.randn(2, 96).to(torch.bfloat16))


@needs_block_kernel
def test_the_int8_kernel_takes_only_float16_scales_and_known_kernels():
    blocks = q4_1_blocks(_weight(8, 64))
    with pytest.raises(ValueError, match="Q4_1 layers run with activations"):
        BlockQuantizedLinear(blocks, activations="int4")
    with pytest.raises(ValueError, match=r"Q8_0 layers run with activations \('int8',\)"):
        BlockQuantizedLinear(_blocks("Q8_0", 8, 64), activations="bf16")
    blocks.scales[0, 0] = 1 / 3
    with pytest.raises(ValueError, match="float16"):
        BlockQuantizedLinear(blocks)
    BlockQuantizedLinear(blocks, activations="bf16")  # float32 scales are fine there


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
    attention = model.model.layers[0].self_attn
    attention.v_proj = BlockQuantizedLinear(attention.v_proj.blocks, activations="bf16")
    fuse_projections(model)
    assert isinstance(mlp.gate_proj, BlockQuantizedLinear)
    assert isinstance(attention.k_proj, BlockQuantizedLinear)  # k (int8) and v (bf16) stay apart


@needs_block_kernel
def test_a_prefill_sized_call_runs_on_a_dense_copy_of_the_same_weights():
    blocks = q4_1_blocks(_weight(48, 64))
    layer = BlockQuantizedLinear(blocks)
    x = torch.randn(DENSE_ROWS, 64).to(torch.bfloat16)
    out = layer(x)
    assert layer._dense and torch.equal(layer._dense[0].weight, blocks.dequantize().to(torch.bfloat16))
    torch.testing.assert_close(out[:5].float(), layer(x[:5]).float(), rtol=0.05, atol=0.02)
    assert set(layer.state_dict()) == {"weight"}


def test_a_dense_weight_rounds_to_q8_0_within_half_a_step_of_each_block():
    weight = _weight(40, 96)
    weight[3, 32:64] = 0  # an all-zero block keeps scale 0 and codes 0
    q8 = Q8Weight.quantize(weight)
    assert q8.codes.dtype == torch.int8 and q8.codes.abs().max() <= 127
    assert torch.equal(q8.scales.half().float(), q8.scales)  # float16 values, as the int8 kernel keeps them
    step = q8.scales.repeat_interleave(32, dim=1)
    assert ((q8.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    assert q8.scales[3, 1] == 0 and (q8.codes[3, 32:64] == 0).all()
    with pytest.raises(ValueError, match="whole blocks of 32"):
        Q8Weight.quantize(_weight(4, 48))


def test_a_dense_weight_rounds_to_q4_1_within_half_a_step_of_each_block():
    weight = _weight(40, 96)
    weight[3, 32:64] = 0.25  # a constant block keeps scale 0, codes 0 and its value as the offset
    q4 = BlockWeight.quantize(weight)
    assert q4.codes.dtype == torch.uint8 and q4.codes.shape == (40, 48)
    for values in (q4.scales, q4.offsets):  # float16 values, as GGUF and the int8 kernel keep them
        assert torch.equal(values.half().float(), values)
    step = q4.scales.repeat_interleave(32, dim=1)
    blocks = weight.reshape(40, 3, 32)
    slack = 1e-3 * (blocks.amax(-1) - blocks.amin(-1) + blocks.amin(-1).abs()).repeat_interleave(32, dim=1)
    assert ((q4.dequantize() - weight).abs() <= step / 2 + slack).all()  # float16 rounding of both halves
    assert q4.scales[3, 1] == 0 and (q4.dequantize()[3, 32:64] == 0.25).all()
    with pytest.raises(ValueError, match="whole blocks of 32"):
        BlockWeight.quantize(_weight(4, 48))


@needs_block_kernel
def test_q8_layers_stack_and_restrict_to_rows_with_each_output_its_own():
    x = torch.randn(3, 64).to(torch.bfloat16)
    layers = [BlockQuantizedLinear(Q8Weight.quantize(_weight(48, 64, seed))) for seed in range(2)]
    stacked = BlockQuantizedLinear.stacked(layers)
    assert torch.equal(stacked(x), torch.cat([layer(x) for layer in layers], dim=-1))
    rows = torch.tensor([5, 0, 47])
    assert torch.equal(layers[0].rows(rows)(x), layers[0](x)[:, rows])


@needs_block_kernel
def test_q4_1_linear_lays_out_plain_bf16_layers_and_q8_0_heads_and_leaves_the_rest():
    x = torch.randn(2, 64).to(torch.bfloat16)
    dense = nn.Linear(64, 24, bias=True).to(torch.bfloat16)
    head = BlockQuantizedLinear(Q8Weight.quantize(_weight(40, 64)))
    for layer in (dense, head):
        q4 = q4_1_linear(layer)
        assert isinstance(q4, BlockQuantizedLinear) and (q4.blocks.format, q4.activations) == ("Q4_1", "int8")
        values = layer.blocks.dequantize() if layer is head else layer.weight  # the Q8_0 values, unrounded
        rounded = BlockWeight.quantize(values)
        assert torch.equal(q4.blocks.codes, rounded.codes) and torch.equal(q4.blocks.scales, rounded.scales)
        bias = None if layer.bias is None else layer.bias.float()
        exact = nn.functional.linear(x.float(), q4.weight.float(), bias)  # int8 inputs aside
        assert torch.allclose(q4(x).float(), exact, atol=0.05)
    assert torch.equal(q4_1_linear(dense).bias, dense.bias)
    q4 = q4_1_linear(dense)
    for kept in (nn.Linear(48, 8).to(torch.bfloat16), nn.Linear(64, 8), q4):  # 48 inputs; float32; done
        assert q4_1_linear(kept) is kept
