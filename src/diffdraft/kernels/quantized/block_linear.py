"""A linear layer whose weight stays in GGUF blocks: Q4_1 layers stream 5 bits a weight instead of 16,
and every format of :data:`INT8_FORMATS` about the bits its file holds.

A decode step on a CPU streams every weight once; SmolLM2-135M's layers hold 212 MB of bf16 weights
and 66 MB of Q4_1 blocks (its LM head 57 MB of bf16, 30 MB of Q8_0). Two kernels run these layers
below ``DENSE_ROWS`` rows; a layer keeps one, so decoding, drafting through the target and verifying
all compute alike:

- ``"int8"`` (the default, ``int8_matmul.cpp``): llama.cpp's arithmetic. Each input row is quantized
  per block of 32 to int8 with a float scale; a block's codes times the weight's codes sum exactly in
  int32 (AVX-512 VNNI, or its AVX2 emulation), then take both blocks' scales in float32 (every
  format's arithmetic: ``int8_matmul.cpp``). It runs SmolLM2's Q4_1 layers much faster than
  ``"bf16"`` at small row counts, and its Q8_0 head (the embedding's blocks) faster than the dense
  bf16 head. Rounding the inputs costs accuracy: SmolLM2's logits sit further from its float32
  model's than ``"bf16"``'s (docs/decisions.md, "GGUF blocks compute as llama.cpp does").
- ``"bf16"`` (``q4_1_matmul.cpp``, Q4_1 only): dequantizes each block in registers to exactly the
  bfloat16 values a dense bf16 copy of the weight holds, so the model is the dense bf16 one up to the
  order of the float32 sums.

Either way each output is one fixed chain of sums, so a token's outputs do not depend on how many
tokens share the call. Inference only, bf16 activations only.

Calls of ``DENSE_ROWS`` rows or more outside :func:`kernel_rows_only` (Hugging Face forwards over
whole sequences: training's taps, the prefill of a family without fused decoder ops) take a dense
copy made on the first such call, on oneDNN's blocked GEMM where it packs bfloat16 (memory, not
bandwidth: decoding never reads it). Those rows round differently from the kernel's. Decoding,
verification and the fused layers' chunked prefill run inside :func:`kernel_rows_only`, so a batch of
trees over 128 tokens still computes each token as its sequence's own decode step would; through the
fused layers that prefill is also faster than Hugging Face's forward on the dense copy
(docs/decisions.md, "prefill through the fused layers").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from diffdraft.kernels.packed_linear import InferenceLinear, dense_linear
from diffdraft.kernels.quantized.gguf_blocks import GGUFBlocks
from diffdraft.kernels.quantized.kernel_build import block_kernel
from diffdraft.kernels.quantized.stacked_blocks import StackedBlocks
from diffdraft.kernels.quantized.tile_layout import (
    BLOCK,
    INT8_FORMATS,
    INT8_OPS,
    TILE,
    float16_bytes,
    tile_bytes,
)

FORMAT = INT8_FORMATS[0]
"""Q4_1: the format of :class:`BlockWeight`, the one the bf16 kernel runs too."""
DENSE_ROWS = 128
"""Rows from which a call runs on the dense copy (see the module docstring)."""
BLOCK_BYTES = 20
"""GGUF bytes per Q4_1 block: float16 scale, float16 offset, 16 bytes of 4-bit codes."""
_KERNEL_ROWS_ONLY = ContextVar("kernel_rows_only", default=False)
ACTIVATIONS = ("int8", "bf16")
"""The layer's kernels (see the module docstring); the first is the default."""


@dataclass
class BlockWeight:
    """A weight [out, in] as Q4_1 blocks of 32 inputs: w = scale * code + offset.

    ``codes`` is [out, in / 2] uint8 (byte j of a block: element j in the low nibble, j + 16 in the
    high one, as in GGUF); ``scales`` and ``offsets`` are [out, in / 32] float32 (GGUF stores float16,
    which float32 holds exactly)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    format: ClassVar[str] = FORMAT

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> BlockWeight:
        """From a GGUF Q4_1 tensor's raw bytes [out, blocks * 20]."""
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES)
        halves = blocks[..., :4].copy().view(np.float16).astype(np.float32)  # [out, blocks, 2]
        codes = np.ascontiguousarray(blocks[..., 4:].reshape(rows, -1))
        return cls(
            torch.from_numpy(codes),
            torch.from_numpy(np.ascontiguousarray(halves[..., 0])),
            torch.from_numpy(np.ascontiguousarray(halves[..., 1])),
        )

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> BlockWeight:
        """Round a dense weight [out, in] (in a multiple of 32) to Q4_1: each block's offset is its
        least value and its scale its range over 15 (both float16, as GGUF stores them), each code the
        nearest to (w - offset) / scale under those stored values. For layers that have no GGUF Q4_1
        blocks, such as a drafter's own (:func:`q4_1_linear`)."""
        out, inputs = weight.shape
        if inputs % BLOCK:
            raise ValueError(f"Q4_1 needs inputs in whole blocks of {BLOCK}; this weight has {inputs}")
        blocks = weight.detach().float().reshape(out, -1, BLOCK)
        offsets = blocks.amin(-1).half().float()
        scales = ((blocks.amax(-1) - offsets) / 15).half().float()
        steps = (blocks - offsets[..., None]) / scales.clamp_min(torch.finfo(torch.float16).tiny)[..., None]
        codes = steps.round().clamp(0, 15).to(torch.uint8)
        packed = codes[..., : BLOCK // 2] | codes[..., BLOCK // 2 :] << 4  # element j low, j + 16 high
        return cls(packed.reshape(out, inputs // 2).contiguous(), scales.contiguous(), offsets.contiguous())

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The weight's rows ``index``, in that order (a reordering of outputs, or a subset)."""
        return BlockWeight(*(part[index].contiguous() for part in (self.codes, self.scales, self.offsets)))

    @staticmethod
    def stack(weights: list[BlockWeight]) -> BlockWeight:
        """The weights' rows one after another (one matmul for sibling projections)."""
        return BlockWeight(
            torch.cat([w.codes for w in weights]),
            torch.cat([w.scales for w in weights]),
            torch.cat([w.offsets for w in weights]),
        )

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight (exact: scale * code is exact in float32, so one rounding)."""
        packed = self.codes.view(self.out_features, -1, BLOCK // 2).to(torch.int16)
        codes = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        values = codes * self.scales[..., None] + self.offsets[..., None]
        return values.reshape(self.out_features, self.in_features)

    def tiles(self) -> torch.Tensor:
        """The int8 kernel's layout of these blocks (:func:`tiled`)."""
        codes = self.codes.view(self.out_features, -1, BLOCK // 2)
        return tiled(codes, self.scales, self.offsets)


@dataclass
class Q8Weight:
    """A weight [out, in] as Q8_0 blocks of 32 inputs, w = scale * code, as GGUFs store embeddings and
    LM heads: ``codes`` [out, in] int8, ``scales`` [out, in / 32] float32 (float16 in GGUF). Runs on the
    int8 kernel only: 34 bytes per 32 weights stream instead of a dense bf16 head's 64."""

    codes: torch.Tensor
    scales: torch.Tensor
    format: ClassVar[str] = "Q8_0"

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> Q8Weight:
        """From a GGUF Q8_0 tensor's raw bytes [out, blocks * 34]: a float16 scale, then 32 codes."""
        rows = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, 2 + BLOCK)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
        return cls(torch.from_numpy(codes), torch.from_numpy(scales))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Q8Weight:
        """Round a dense weight [out, in] (in a multiple of 32) to Q8_0 as GGUF converters do: each
        block's scale is its largest magnitude over 127 (in float16), each code its weight over the
        scale, rounded. For a layer that has no GGUF blocks (drafters round theirs to Q4_1 instead:
        :func:`q4_1_linear`)."""
        out, inputs = weight.shape
        if inputs % BLOCK:
            raise ValueError(f"Q8_0 needs inputs in whole blocks of {BLOCK}; this weight has {inputs}")
        blocks = weight.detach().float().reshape(out, -1, BLOCK)
        scales = (blocks.abs().amax(-1) / 127).half().float()
        codes = (blocks / scales.clamp_min(torch.finfo(torch.float16).tiny)[..., None]).round()
        return cls(codes.clamp(-127, 127).to(torch.int8).reshape(out, inputs).contiguous(), scales)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def rows(self, index: torch.Tensor) -> Q8Weight:
        """The weight's rows ``index``, in that order (a draft vocabulary's rows of an LM head, say)."""
        return Q8Weight(self.codes[index].contiguous(), self.scales[index].contiguous())

    @staticmethod
    def stack(weights: list[Q8Weight]) -> Q8Weight:
        """The weights' rows one after another (one matmul for sibling projections)."""
        return Q8Weight(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]))

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight (exact, as for Q4_1)."""
        values = self.codes.float().view(self.out_features, -1, BLOCK) * self.scales[..., None]
        return values.reshape(self.out_features, self.in_features)

    def tiles(self) -> torch.Tensor:
        """The int8 kernel's layout, codes stored plus 128 (the kernel's unsigned operand)."""
        codes = (self.codes.view(torch.uint8) ^ 128).view(self.out_features, -1, BLOCK)
        return tiled(codes, self.scales)


def tiled(codes: torch.Tensor, *halves: torch.Tensor) -> torch.Tensor:
    """Blocks in ``int8_matmul.cpp``'s layout, uint8 [tiles, blocks, bytes], from codes [out, blocks,
    bytes] and float16-valued scales (and offsets) [out, blocks]: per tile of 16 outputs and block,
    four code bytes of each output in turn (an int32 lane each), then each of ``halves`` as 16 float16.
    The outputs are padded with zero blocks to whole tiles. The weight is streamed once per forward,
    so it streams whole and in order; float16 holds GGUF's scales exactly, in half of float32's bytes."""
    parts = [tile_bytes(codes, 4), *(tile_bytes(float16_bytes(values), 2) for values in halves)]
    return torch.cat(parts, dim=-1).contiguous()


class BlockQuantizedLinear(InferenceLinear):
    """``nn.Linear`` over a :class:`BlockWeight`, a :class:`Q8Weight`, a ``GGUFBlocks`` (any of
    :data:`INT8_FORMATS`) or siblings of several stacked (``StackedBlocks``), computed by the
    ``activations`` kernel (one of :data:`ACTIVATIONS`; the bf16 one takes Q4_1 only); :attr:`weight`
    rebuilds the dense bf16 weight on demand."""

    def __init__(
        self,
        weight: BlockWeight | Q8Weight | GGUFBlocks | StackedBlocks,
        bias: torch.Tensor | None = None,
        activations: str = ACTIVATIONS[0],
        tiles: torch.Tensor | None = None,
    ) -> None:
        """``tiles``: the int8 kernel's layout of ``weight`` when already made (``weight.tiles()``, the
        slow part of putting a big model's layers on blocks), else made here."""
        super().__init__()
        kernel = block_kernel()
        if kernel is None:
            raise RuntimeError("the block CPU kernels are unavailable here; check block_kernel() first")
        kernels = ACTIVATIONS if weight.format == FORMAT else ACTIVATIONS[:1]
        if activations not in kernels:
            raise ValueError(f"{weight.format} layers run with activations {kernels}; got {activations!r}")
        self.activations = activations
        self.blocks = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        if activations == "int8":
            self._matmul = getattr(kernel, f"{weight.format.lower()}_int8_matmul")
            self._operands = (weight.tiles() if tiles is None else tiles, self.out_features)
        else:
            self._matmul = kernel.q4_1_matmul
            self._operands = (weight.codes, weight.scales, weight.offsets)
        self._dense: list[torch.nn.Module] = []  # a list, so the copy is no submodule (nor in state_dict)

    @property
    def weight(self) -> torch.Tensor:
        return self.blocks.dequantize().to(torch.bfloat16)

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The weight tensors every call hands the kernel (its tiles, or the bf16 kernel's codes, scales
        and offsets): what a forward streams from memory."""
        return [operand for operand in self._operands if isinstance(operand, torch.Tensor)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{self.blocks.format} layers compute in bfloat16; got {x.dtype} inputs")
        if x.numel() >= DENSE_ROWS * self.in_features and not _KERNEL_ROWS_ONLY.get():
            if not self._dense:
                self._dense.append(dense_linear(self.weight, self.bias))
            return self._dense[0](x)
        return self._matmul(x, *self._operands, self.bias)

    def int8_operands(self) -> tuple[torch.Tensor, int, int, torch.Tensor | None] | None:
        """(weight tiles, output width, op number in :data:`INT8_OPS`, bias): what a C++ caller passes
        the int8 kernel for this layer (``decoder_loop.cpp``); None on the bf16 kernel."""
        if self.activations != "int8":
            return None
        return *self._operands, INT8_OPS.index(self.blocks.format), self.bias

    def stack_key(self) -> tuple:
        return *super().stack_key(), self.activations

    @classmethod
    def can_stack(cls, siblings: list[InferenceLinear]) -> bool:
        """Siblings of one format stack into one weight of it; on the int8 kernel, siblings of several
        formats (a Q4_K_M layer's v in Q6_K beside q and k in Q4_K) stack as a :class:`StackedBlocks`
        when all but the last fill whole tiles of outputs."""
        if not super().can_stack(siblings):
            return False
        if len({sibling.blocks.format for sibling in siblings}) == 1:
            return True
        return siblings[0].activations == "int8" and all(s.out_features % TILE == 0 for s in siblings[:-1])

    @classmethod
    def stacked(cls, siblings: list[BlockQuantizedLinear]) -> BlockQuantizedLinear:
        """The siblings' weights stacked; on the int8 kernel their tiles are reused where each sibling
        but the last fills whole tiles (the tiles of a stack are then its siblings' in turn)."""
        weights = [sibling.blocks for sibling in siblings]
        bias, activations = cls.stacked_bias(siblings), siblings[0].activations
        whole_tiles = all(sibling.out_features % TILE == 0 for sibling in siblings[:-1])
        nested = any(isinstance(weight, StackedBlocks) for weight in weights)  # tiles behind a header
        if nested or len({weight.format for weight in weights}) > 1:
            weight = StackedBlocks.of(weights)
            tiles = None if nested else weight.tiles([s._operands[0] for s in siblings])
            return cls(weight, bias, activations, tiles=tiles)
        weight = type(weights[0]).stack(weights)
        if activations == "int8" and whole_tiles:
            return cls(weight, bias, activations, tiles=torch.cat([s._operands[0] for s in siblings]))
        return cls(weight, bias, activations)

    def rows(self, index: torch.Tensor) -> BlockQuantizedLinear:
        """This layer restricted to outputs ``index`` (an LM head's draft vocabulary), on the same kernel."""
        bias = None if self.bias is None else self.bias[index]
        return BlockQuantizedLinear(self.blocks.rows(index.cpu()), bias, self.activations)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.blocks.format}, activations={self.activations}, bias={self.bias is not None}"
        )


def int8_operands(linear: torch.nn.Module) -> tuple[torch.Tensor, int, int, torch.Tensor | None] | None:
    """:meth:`BlockQuantizedLinear.int8_operands` of ``linear``; None for any other layer."""
    return linear.int8_operands() if isinstance(linear, BlockQuantizedLinear) else None


def q4_1_linear(linear: torch.nn.Module) -> torch.nn.Module:
    """``linear`` on the int8 kernel over its weight rounded to Q4_1, when it is a plain bfloat16
    ``nn.Linear`` on a CPU with the kernel, or an int8-kernel layer of another block format (a target's
    LM head cut to a draft vocabulary), and its inputs come in whole blocks; else itself. For a drafter beside
    an int8 block target: its proposals only steer what the target verifies, so rounding its weights
    costs no losslessness, and a drafting round streams 5 bits a weight: on Q8_0's 8.5 the default
    drafter's rounds took longer for proposals barely better, a loss at small budgets (docs/decisions.md,
    "a drafter beside a GGUF target drafts on Q4_1")."""
    if isinstance(linear, BlockQuantizedLinear):
        dense = linear.blocks.dequantize() if linear.blocks.format != FORMAT else None
    elif type(linear) is torch.nn.Linear and linear.weight.dtype == torch.bfloat16:
        dense = linear.weight if linear.weight.device.type == "cpu" else None
    else:
        dense = None
    if dense is None or linear.in_features % BLOCK or block_kernel() is None:
        return linear
    return BlockQuantizedLinear(BlockWeight.quantize(dense), linear.bias, "int8")


def runs_int8_kernel(model: torch.nn.Module) -> bool:
    """Whether some of ``model``'s layers compute on the int8 kernel (llama.cpp's arithmetic)."""
    return any(kind.endswith("/int8") for kind in block_kernels(model))


@contextmanager
def kernel_rows_only() -> Iterator[None]:
    """Within it, block layers compute every call on their kernel, however many rows (no dense copy)."""
    token = _KERNEL_ROWS_ONLY.set(True)
    try:
        yield
    finally:
        _KERNEL_ROWS_ONLY.reset(token)


def has_block_layers(model: torch.nn.Module) -> bool:
    return bool(block_kernels(model))


def block_kernels(model: torch.nn.Module) -> list[str]:
    """The model's block formats and kernels, such as ``["Q4_1/int8", "Q8_0/int8"]`` (none: dense)."""
    kinds = {
        f"{weight.format}/{module.activations}"
        for module in model.modules()
        if isinstance(module, BlockQuantizedLinear)
        for weight in getattr(module.blocks, "parts", [module.blocks])
    }
    return sorted(kinds)
