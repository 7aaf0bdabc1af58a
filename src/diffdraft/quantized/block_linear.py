"""A linear layer whose weight stays in GGUF Q4_1 blocks: 5 bits a weight to stream instead of 16.

A decode step on a CPU streams every weight once; SmolLM2-135M's layers hold 212 MB of bf16 weights
and 66 MB of Q4_1 blocks. The kernel (``q4_1_matmul.cpp``) dequantizes each block in registers to
exactly the bfloat16 values a dense bf16 copy of the weight holds, so a model on these layers is the
same model as the dense bf16 one; only the order of the float32 sums differs. Each output is one fixed
chain of sums, so a token's outputs do not depend on how many tokens share the call. Inference only,
bf16 only. (Q8_0 blocks, as GGUFs store the embedding, do not pay: dequantizing 8-bit codes costs
more than oneDNN spends streaming the dense bf16 weight.)

Many rows at once (a prompt's prefill) turn the kernel compute-bound: it dequantizes each block once
per 16 rows. There oneDNN's blocked GEMM on the dense weight is several times faster, so calls of
``DENSE_ROWS`` rows or more take a dense copy made on the first such call (memory, not bandwidth:
decoding never reads it). Those rows round differently from the kernel's, which costs nothing to
losslessness: every method prefills its prompt the same way, and verifications stay far below.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffdraft.packed_linear import InferenceLinear, PackedLinear
from diffdraft.quantized.kernel_build import block_kernel

FORMAT = "Q4_1"
BLOCK = 32
"""Inputs per block."""
DENSE_ROWS = 128
"""Rows from which a call runs on the dense copy (see the module docstring)."""
BLOCK_BYTES = 20
"""GGUF bytes per Q4_1 block: float16 scale, float16 offset, 16 bytes of 4-bit codes."""


@dataclass
class BlockWeight:
    """A weight [out, in] as Q4_1 blocks of 32 inputs: w = scale * code + offset.

    ``codes`` is [out, in / 2] uint8 (byte j of a block: element j in the low nibble, j + 16 in the
    high one, as in GGUF); ``scales`` and ``offsets`` are [out, in / 32] float32 (GGUF stores float16,
    which float32 holds exactly)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

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


class BlockQuantizedLinear(InferenceLinear):
    """``nn.Linear`` over a :class:`BlockWeight`; :attr:`weight` rebuilds the dense bf16 weight on demand."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        kernel = block_kernel()
        if kernel is None:
            raise RuntimeError("the Q4_1 CPU kernel is unavailable here; check block_kernel() first")
        self._matmul = kernel.q4_1_matmul
        self.blocks = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self._dense: list[PackedLinear] = []  # a list, so the copy is no submodule (nor in state_dict)

    @property
    def weight(self) -> torch.Tensor:
        return self.blocks.dequantize().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"Q4_1 layers compute in bfloat16; got {x.dtype} inputs")
        if x.numel() >= DENSE_ROWS * self.in_features:
            if not self._dense:
                self._dense.append(PackedLinear(self.weight, self.bias))
            return self._dense[0](x)
        return self._matmul(x, self.blocks.codes, self.blocks.scales, self.blocks.offsets, self.bias)

    @classmethod
    def stacked(cls, siblings: list[BlockQuantizedLinear]) -> BlockQuantizedLinear:
        return cls(BlockWeight.stack([sibling.blocks for sibling in siblings]), cls.stacked_bias(siblings))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={FORMAT}, bias={self.bias is not None}"
        )


def has_block_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(module, BlockQuantizedLinear) for module in model.modules())
