"""Put a GGUF file's quantized blocks back into the model transformers dequantized from it.

transformers reads a GGUF into dense weights; for inference we want the blocks. Each linear layer's
GGUF tensor is found by name, its rows reordered the way transformers reorders them (Llama GGUFs store
q and k with the rotary halves interleaved), and its blocks kept only when they dequantize to exactly
the weight the model holds: a wrong name or order can never change the model, only leave it dense.

By default the layers run the int8 kernel (inputs quantized per block to int8, llama.cpp's arithmetic),
each tensor on its own format's kernel (a Q4_K_M file mixes Q4_K, Q6_K and, on widths that are no
multiple of 256, Q5_0 and Q8_0), and the LM head joins them on its file's blocks (the tied embedding's,
usually): the model then computes what llama.cpp computes, close to but not exactly the dense bf16
model. ``activations="bf16"`` keeps exactly the dense bf16 model's weights and bf16 inputs instead: Q4_1
layers only, the rest and the head dense.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from torch import nn

from diffdraft.kernels.quantized.block_linear import (
    ACTIVATIONS,
    FORMAT,
    BlockQuantizedLinear,
    BlockWeight,
    Q8Weight,
)
from diffdraft.kernels.quantized.gguf_blocks import GGUFBlocks
from diffdraft.kernels.quantized.kernel_build import block_kernel
from diffdraft.kernels.quantized.tile_layout import INT8_FORMATS
from diffdraft.util.progress import progress_bar

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
HEAD_TENSORS = ("output.weight", "token_embd.weight")
"""The LM head's GGUF tensor: its own, else the embedding it is tied to."""


def block_weights_supported(model: nn.Module) -> bool:
    """Whether the block kernel can serve ``model``: bfloat16 on a CPU that has the kernel."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16 and block_kernel() is not None


def block_weight(raw: np.ndarray, format: str) -> BlockWeight | Q8Weight | GGUFBlocks:
    """A GGUF tensor's raw bytes [out, bytes per row] of ``format`` (one of :data:`INT8_FORMATS`) as the
    weight class that holds that format."""
    if format == FORMAT:
        return BlockWeight.from_gguf(raw)
    if format == "Q8_0":
        return Q8Weight.from_gguf(raw)
    return GGUFBlocks.from_gguf(raw, format)


@dataclass(frozen=True)
class Placement:
    """A linear layer put on a GGUF tensor's blocks: the module's name, the tensor's, its format, for a
    Llama GGUF's q or k the head count whose rotary rows transformers reorders (else None), and where
    its bytes lie in the file (offset, rows, bytes a row), so a cached load reads them without parsing
    the file's metadata (GGUFReader reads a big vocabulary's strings one by one, for many seconds)."""

    module: str
    tensor: str
    format: str
    heads: int | None
    offset: int
    rows: int
    row_bytes: int

    def raw(self, gguf: Path) -> np.ndarray:
        """The tensor's bytes [rows, row_bytes], memory-mapped read-only from ``gguf``."""
        return np.memmap(
            gguf, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.rows, self.row_bytes)
        )


def use_gguf_blocks(model: nn.Module, gguf: Path, activations: str = ACTIVATIONS[0]) -> list[Placement]:
    """Replace ``model``'s linear layers by :class:`BlockQuantizedLinear` layers on ``gguf``'s blocks
    where the GGUF stores them in a format of :data:`INT8_FORMATS` (Q4_1 only for ``activations="bf16"``),
    its LM head included (int8 only); returns the layers replaced. Tensors of other formats (F16, Q5_1,
    Q3_K, ...) leave their layers dense, which one stderr line names. A tied embedding keeps its dense
    weight for lookups."""
    reader = GGUFReader(gguf)
    architecture = _field(reader, "general.architecture")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model.config
    names = _linear_names(tensors, config.num_hidden_layers)
    if activations == "int8":
        names += [(name, "lm_head") for name in HEAD_TENSORS if name in tensors][:1]
    formats = INT8_FORMATS if activations == "int8" else (FORMAT,)
    placed: list[Placement] = []
    mismatched = 0
    dense: dict[str, list[str]] = {}
    for gguf_name, module_name in progress_bar(names, desc=f"diffdraft: {gguf.name}'s blocks", unit="tensor"):
        tensor = tensors[gguf_name]
        linear = model.get_submodule(module_name)
        if type(linear) is not nn.Linear:
            continue
        if tensor.tensor_type.name not in formats:
            dense.setdefault(tensor.tensor_type.name, []).append(gguf_name)
            continue
        heads = None
        if architecture == "llama" and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
        data = np.asarray(tensor.data)
        placement = Placement(
            module_name, gguf_name, tensor.tensor_type.name, heads, int(tensor.data_offset), *data.shape
        )
        weight = placed_weight(data, placement)
        if not torch.equal(weight.dequantize().to(linear.weight.dtype), linear.weight):
            mismatched += 1
            continue
        _replace(model, module_name, BlockQuantizedLinear(weight, linear.bias, activations))
        placed.append(placement)
    if mismatched:
        print(
            f"diffdraft: {mismatched} GGUF tensors of {gguf.name} do not match the loaded weights; those "
            "layers stay dense (same outputs, slower).",
            file=sys.stderr,
        )
    if dense:
        kinds = "; ".join(f"{kind}: {_names(found)}" for kind, found in sorted(dense.items()))
        print(
            f"diffdraft: {sum(map(len, dense.values()))} linear layers of {gguf.name} stay dense (same "
            f"outputs, slower): the {activations} kernel runs {', '.join(formats)}, not {kinds}.",
            file=sys.stderr,
        )
    return placed


def place_blocks(
    model: nn.Module,
    gguf: Path,
    placements: list[Placement],
    activations: str,
    biases: dict[str, torch.Tensor],
    tiles: dict[str, torch.Tensor],
) -> None:
    """Put ``model``'s layers on ``gguf``'s blocks as :func:`use_gguf_blocks` placed them before
    (``placements``), with their ``biases`` and the int8 kernel's ``tiles`` it laid out then, both by
    module name: no dense weights to compare with, no layout to compute (a cached load)."""
    for placement in placements:
        weight = placed_weight(placement.raw(gguf), placement)
        layer = BlockQuantizedLinear(
            weight, biases.get(placement.module), activations, tiles=tiles.get(placement.module)
        )
        _replace(model, placement.module, layer)


def placed_weight(raw: np.ndarray, placement: Placement) -> BlockWeight | Q8Weight | GGUFBlocks:
    """The blocks of ``placement``'s tensor, its bytes ``raw``, in the model's row order."""
    weight = block_weight(raw, placement.format)
    if placement.heads is not None:
        weight = weight.rows(_unpermuted_rows(weight.out_features, placement.heads))
    return weight


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attribute, module)


def _names(tensors: list[str]) -> str:
    """A few tensor names, then how many more."""
    shown = ", ".join(tensors[:3])
    return shown if len(tensors) <= 3 else f"{shown} and {len(tensors) - 3} more"


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
