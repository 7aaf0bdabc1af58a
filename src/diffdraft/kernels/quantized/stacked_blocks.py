"""Sibling projections whose GGUF tensors differ in format, stacked into one call of the int8 kernel.

A Q4_K_M file keeps most of a layer's q, k and v in Q4_K but gives v (and the MLP's down) Q6_K in
about half the layers, and on widths that are no multiple of 256 its q and k fall back to Q5_0 beside a
Q8_0 v. Left apart, such siblings cost the fused decoder loop, which takes a layer's q|k|v and gate|up
as one linear each; stacked, ``stacked_int8_matmul`` quantizes the input once (every format shares
that rounding) and runs each sibling's tiles on its own format's kernel, so each column keeps the
bits its sibling's own call gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from diffdraft.kernels.quantized.tile_layout import INT8_OPS, STACKED, TILE


@dataclass
class StackedBlocks:
    """The weights ``parts`` (their formats may differ; every part but the last a whole number of
    tiles of outputs) as one weight of their rows one after another."""

    parts: list
    """``block_linear.BlockWeight``, ``Q8Weight`` or ``gguf_blocks.GGUFBlocks`` weights."""
    format: ClassVar[str] = STACKED

    @classmethod
    def of(cls, weights: list) -> StackedBlocks:
        """``weights`` stacked; a stacked one among them contributes its parts."""
        parts = [part for weight in weights for part in getattr(weight, "parts", [weight])]
        if any(part.out_features % TILE for part in parts[:-1]):
            raise ValueError(f"siblings stacked across formats need widths in whole tiles of {TILE} outputs")
        if len({part.in_features for part in parts}) > 1:
            raise ValueError("stacked siblings read one input: their input widths must agree")
        return cls(parts)

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight, each part's rows in turn."""
        return torch.cat([part.dequantize() for part in self.parts])

    def tiles(self, part_tiles: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``stacked_int8_matmul``'s layout: int64 header (count, then each part's op number and width),
        then each part's tiles (``part_tiles`` where the parts' layers made them already), all as one
        uint8 tensor."""
        if part_tiles is None:
            part_tiles = [part.tiles() for part in self.parts]
        header = [len(self.parts)]
        for part in self.parts:
            header += [INT8_OPS.index(part.format), part.out_features]
        bytes_ = [torch.tensor(header, dtype=torch.int64).view(torch.uint8)]
        bytes_ += [tiles.reshape(-1) for tiles in part_tiles]
        return torch.cat(bytes_).contiguous()
