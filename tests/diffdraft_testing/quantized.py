"""GGUF block-quantized weights and files: random blocks of every format, Q4_1 targets, and the int8
kernel's rounding of its inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from diffdraft_testing.targets import tiny_target


def q4_1_blocks(weight: torch.Tensor):
    """``weight`` quantized to GGUF Q4_1 blocks by the reference quantizer of the ``gguf`` package."""
    from gguf import GGMLQuantizationType, quants

    from diffdraft.kernels.quantized.block_linear import BlockWeight

    raw = quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q4_1)
    return BlockWeight.from_gguf(raw)


def int8_rounded_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's rounding of inputs ``x`` [..., in]: each row's blocks of 32 as codes
    round(x * 127 / max|x|) in float32 (the kernel's codes exactly) [rows, blocks, 32], and their scales
    max|x| / 127 [rows, blocks], both as float64."""
    x = x.float().reshape(-1, x.shape[-1] // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, 0)  # (127 / amax would be amax^-1 * 127)
    return torch.round(x * inverse).double(), (amax / 127).double()[..., 0]


GGUF_FLOAT16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
"""Byte offsets of each format's float16 scales (d, and dmin or m) within a GGUF block."""


def random_gguf_bytes(format: str, out: int, inputs: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """A GGUF tensor [out, bytes per row] of random bytes (every code, sub-scale and min a file may
    hold) whose float16 fields are normal values of std ``scale``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block_inputs, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    raw = rng.integers(0, 256, (out, inputs // block_inputs, size), dtype=np.uint8)
    for offset in GGUF_FLOAT16_FIELDS[format]:
        values = (rng.standard_normal((out, inputs // block_inputs)) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def write_random_gguf(path: Path, model: torch.nn.Module, formats: dict[str, str], seed: int = 0) -> None:
    """``model`` (a Qwen2) as a GGUF whose decoder-layer tensors ``blk.N.<key>`` are random blocks of
    ``formats[key]`` (a key missing there keeps its layer dense: an F32 tensor), and its LM head
    ``output`` of ``formats["output"]`` if given, the model's own weights set to what the file holds;
    the embedding stays dense."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from diffdraft.kernels.quantized.gguf_weights import LAYER_TENSORS

    writer = GGUFWriter(str(path), "qwen2")
    for i, layer in enumerate(model.model.layers):
        for key, name in LAYER_TENSORS.items():
            linear = layer.get_submodule(name)
            if key not in formats:
                writer.add_tensor(f"blk.{i}.{key}.weight", linear.weight.detach().float().numpy())
                continue
            kind = GGMLQuantizationType[formats[key]]
            raw = random_gguf_bytes(
                formats[key], *linear.weight.shape, seed=seed * 1000 + 10 * i + len(key), scale=2e-3
            )
            linear.weight.data = torch.from_numpy(quants.dequantize(raw, kind)).to(linear.weight.dtype)
            writer.add_tensor(f"blk.{i}.{key}.weight", raw, raw_dtype=kind)
    if "output" in formats:
        kind = GGMLQuantizationType[formats["output"]]
        raw = random_gguf_bytes(formats["output"], *model.lm_head.weight.shape, seed=seed, scale=2e-3)
        model.lm_head.weight.data = torch.from_numpy(quants.dequantize(raw, kind)).to(
            model.lm_head.weight.dtype
        )
        writer.add_tensor("output.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_1_target(family: str = "llama", seed: int = 0, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target whose decoder-layer weights are Q4_1 blocks: (bf16 model on
    :class:`BlockQuantizedLinear` layers, float32 dense model of the same weights)."""
    from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear

    kwargs.setdefault("hidden", 64)  # block-quantized widths are multiples of 32
    dense = tiny_target(family, seed=seed, dtype=torch.float32, **kwargs)
    model = tiny_target(family, seed=seed, dtype=torch.bfloat16, **kwargs)
    for name, linear in list(dense.model.layers.named_modules()):
        if isinstance(linear, torch.nn.Linear):
            blocks = q4_1_blocks(linear.weight)
            linear.weight.data = blocks.dequantize()
            parent_name, _, attribute = name.rpartition(".")
            parent = model.model.layers.get_submodule(parent_name)
            setattr(parent, attribute, BlockQuantizedLinear(blocks, getattr(parent, attribute).bias))
    return model, dense
