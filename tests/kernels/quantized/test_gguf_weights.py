"""Reading a GGUF's Q4_1 blocks into the model transformers built from it: right rows, or left dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear
from diffdraft.kernels.quantized.gguf_weights import LAYER_TENSORS, _unpermuted_rows, use_gguf_blocks

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.targets import tiny_target


def test_q_and_k_rows_are_reordered_as_transformers_reorders_them():
    rows, heads = 48, 3
    weights = np.arange(rows)[:, None]
    expected = LlamaTensorProcessor()._reverse_permute_weights(weights, heads, heads)[:, 0]
    assert _unpermuted_rows(rows, heads).tolist() == expected.tolist()


def _quantize(linear: nn.Module, kind: GGMLQuantizationType) -> np.ndarray:
    """``linear``'s weight as ``kind`` blocks; the weight is set to the blocks' values, as transformers
    would have read them from the GGUF."""
    raw = quants.quantize(linear.weight.detach().float().numpy(), kind)
    linear.weight.data = torch.from_numpy(quants.dequantize(raw, kind)).to(linear.weight.dtype)
    return raw


def _write_gguf(path, model: nn.Module) -> None:
    """The model as a Llama GGUF: decoder-layer weights as Q4_1, q and k rows in GGUF's order; the
    embedding, and an untied LM head, as Q8_0."""
    writer = GGUFWriter(str(path), "llama")
    for i, layer in enumerate(model.model.layers):
        for key, name in LAYER_TENSORS.items():
            raw = _quantize(layer.get_submodule(name), GGMLQuantizationType.Q4_1)
            if key in ("attn_q", "attn_k"):
                heads = (
                    model.config.num_attention_heads if key == "attn_q" else model.config.num_key_value_heads
                )
                raw = raw[np.argsort(_unpermuted_rows(raw.shape[0], heads).numpy())]
            writer.add_tensor(f"blk.{i}.{key}.weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
    heads = {"token_embd.weight": model.model.embed_tokens}
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        heads["output.weight"] = model.lm_head
    for name, module in heads.items():
        writer.add_tensor(
            name, _quantize(module, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_block_kernel
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("activations", "tolerance"), [("bf16", 0.05), ("int8", 0.5)])
def test_every_linear_layer_gets_its_blocks_and_the_model_its_logits(tmp_path, activations, tolerance, tied):
    model = tiny_target("llama", dtype=torch.bfloat16, hidden=64, layers=2, tie_word_embeddings=tied)
    _write_gguf(tmp_path / "tiny.gguf", model)
    embedding = model.model.embed_tokens.weight.clone()
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    head = activations == "int8"  # the bf16 kernel takes Q4_1 only, so the Q8_0 head stays dense there
    with torch.no_grad():
        dense_logits = model(ids).logits.float()
        assert len(use_gguf_blocks(model, tmp_path / "tiny.gguf", activations)) == 7 * 2 + head
        block_logits = model(ids).logits.float()
    layers = [m for m in model.modules() if isinstance(m, BlockQuantizedLinear)]
    assert len(layers) == 14 + head and all(layer.activations == activations for layer in layers)
    assert isinstance(model.lm_head, BlockQuantizedLinear if head else nn.Linear)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # lookups keep the dense embedding
    # bf16: the same weights, sums in another order; int8: inputs rounded to 8 bits (logits span +-5)
    torch.testing.assert_close(block_logits, dense_logits, rtol=0.05, atol=tolerance)


@needs_block_kernel
def test_a_tensor_that_does_not_match_the_weights_leaves_its_layer_dense(tmp_path, capsys):
    model = tiny_target("llama", dtype=torch.bfloat16, hidden=64, layers=2)
    _write_gguf(tmp_path / "tiny.gguf", model)
    up = model.model.layers[1].mlp.up_proj
    up.weight.data[0, 0] += 1.0
    assert len(use_gguf_blocks(model, tmp_path / "tiny.gguf")) == 13 + 1
    assert model.model.layers[1].mlp.up_proj is up
    assert "1 GGUF tensors of tiny.gguf do not match" in capsys.readouterr().err


@needs_block_kernel
@pytest.mark.real_model
def test_the_default_target_keeps_its_gguf_blocks():
    from diffdraft.target.loading import load_target

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
    assert isinstance(loaded.model.lm_head, BlockQuantizedLinear)  # on the embedding's Q8_0 blocks
    assert f"{7 * len(layers) + 1} linear layers on its GGUF blocks (int8 activations)" in loaded.source
