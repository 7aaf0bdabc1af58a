"""Put a GGUF file's quantized blocks back into the model transformers dequantized from it.

transformers reads a GGUF into dense weights; for inference we want the blocks. Each linear layer's
GGUF tensor is found by name, its rows reordered the way transformers reorders them (Llama GGUFs store
q and k with the rotary halves interleaved), and its blocks kept only when they dequantize to exactly
the weight the model holds: a wrong name or order can never change the model, only leave it dense.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from torch import nn

from diffdraft.quantized.block_linear import FORMAT, BlockQuantizedLinear, BlockWeight
from diffdraft.quantized.kernel_build import block_kernel

LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF tensor ``blk.N.<key>`` -> module ``model.layers.N.<value>`` (Llama, Qwen2, Qwen3)."""


def block_weights_supported(model: nn.Module) -> bool:
    """Whether the block kernel can serve ``model``: bfloat16 on a CPU that has the kernel."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16 and block_kernel() is not None


def use_gguf_blocks(model: nn.Module, gguf: Path) -> int:
    """Replace ``model``'s linear layers by :class:`BlockQuantizedLinear` layers on ``gguf``'s blocks
    where the GGUF stores them as Q4_1 (the format the kernel runs); returns how many were replaced.
    The LM head stays dense: GGUFs store it as Q8_0 or better, which the kernel does not take."""
    reader = GGUFReader(gguf)
    architecture = _field(reader, "general.architecture")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model.config
    replaced = mismatched = 0
    for gguf_name, module_name in _linear_names(tensors, config.num_hidden_layers):
        tensor = tensors[gguf_name]
        parent_name, _, attribute = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attribute)
        if tensor.tensor_type.name != FORMAT or type(linear) is not nn.Linear:
            continue
        weight = BlockWeight.from_gguf(np.asarray(tensor.data))
        if architecture == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            weight = weight.rows(_unpermuted_rows(weight.out_features, heads))
        if not torch.equal(weight.dequantize().to(linear.weight.dtype), linear.weight):
            mismatched += 1
            continue
        setattr(parent, attribute, BlockQuantizedLinear(weight, linear.bias))
        replaced += 1
    if mismatched:
        print(
            f"diffdraft: {mismatched} GGUF tensors of {gguf.name} do not match the loaded weights; those "
            "layers stay dense (same outputs, slower).",
            file=sys.stderr,
        )
    return replaced


def _linear_names(tensors: dict, layers: int) -> list[tuple[str, str]]:
    names = [
        (f"blk.{i}.{key}.weight", f"model.layers.{i}.{module}")
        for i in range(layers)
        for key, module in LAYER_TENSORS.items()
    ]
    return [(gguf_name, module) for gguf_name, module in names if gguf_name in tensors]


def _unpermuted_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a Llama GGUF's q or k weight: within each head, GGUF keeps the
    two rotary halves' rows interleaved (0, d/2, 1, d/2 + 1, ...), Hugging Face keeps them apart."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)


def _field(reader: GGUFReader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()
