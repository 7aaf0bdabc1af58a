"""Reading a GGUF's Q4_1 blocks into the model transformers built from it: right rows, or left dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from diffdraft.quantized.block_linear import BlockQuantizedLinear
from diffdraft.quantized.gguf_weights import LAYER_TENSORS, _unpermuted_rows, use_gguf_blocks

from conftest import needs_block_kernel, tiny_target


def test_q_and_k_rows_are_reordered_as_transformers_reorders_them():
    rows, heads = 48, 3
    weights = np.arange(rows)[:, None]
    expected = LlamaTensorProcessor()._reverse_permute_weights(weights, heads, heads)[:, 0]
    assert _unpermuted_rows(rows, heads).tolist() == expected.tolist()


def _write_gguf(path, model: nn.Module) -> None:
    """The model's decoder-layer weights as a Llama GGUF of Q4_1 tensors, q and k rows in GGUF's order;
    the model's weights are set to the blocks' values, as transformers would have read them."""
    writer = GGUFWriter(str(path), "llama")
    for i, layer in enumerate(model.model.layers):
        for key, name in LAYER_TENSORS.items():
            linear = layer.get_submodule(name)
            weight = linear.weight.detach().float().numpy()
            raw = quants.quantize(weight, GGMLQuantizationType.Q4_1)
            linear.weight.data = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_1)).to(
                linear.weight.dtype
            )
            if key in ("attn_q", "attn_k"):
                heads = (
                    model.config.num_attention_heads if key == "attn_q" else model.config.num_key_value_heads
                )
                raw = raw[np.argsort(_unpermuted_rows(raw.shape[0], heads).numpy())]
            writer.add_tensor(f"blk.{i}.{key}.weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_block_kernel
def test_every_linear_layer_gets_its_blocks_and_the_model_its_logits(tmp_path):
    model = tiny_target("llama", dtype=torch.bfloat16, hidden=64, layers=2)
    _write_gguf(tmp_path / "tiny.gguf", model)
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    with torch.no_grad():
        dense_logits = model(ids).logits.float()
        assert use_gguf_blocks(model, tmp_path / "tiny.gguf") == 7 * 2
        block_logits = model(ids).logits.float()
    assert sum(isinstance(m, BlockQuantizedLinear) for m in model.modules()) == 14
    assert isinstance(model.lm_head, nn.Linear)  # the head stays dense
    torch.testing.assert_close(block_logits, dense_logits, rtol=0.05, atol=0.05)


@needs_block_kernel
def test_a_tensor_that_does_not_match_the_weights_leaves_its_layer_dense(tmp_path, capsys):
    model = tiny_target("llama", dtype=torch.bfloat16, hidden=64, layers=2)
    _write_gguf(tmp_path / "tiny.gguf", model)
    up = model.model.layers[1].mlp.up_proj
    up.weight.data[0, 0] += 1.0
    assert use_gguf_blocks(model, tmp_path / "tiny.gguf") == 13
    assert model.model.layers[1].mlp.up_proj is up
    assert "1 GGUF tensors of tiny.gguf do not match" in capsys.readouterr().err


@needs_block_kernel
@pytest.mark.real_model
def test_the_default_target_keeps_its_gguf_blocks():
    from diffdraft.loading import load_target

    loaded = load_target("default", dtype="bfloat16", optimize=True)
    layers = loaded.model.model.layers
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (
            attention.q_proj.stacked.linear,
            attention.o_proj,
            mlp.gate_proj.stacked.linear,
            mlp.down_proj,
        ):
            assert isinstance(linear, BlockQuantizedLinear)
    assert f"{7 * len(layers)} linear layers on its Q4_1 blocks" in loaded.source
