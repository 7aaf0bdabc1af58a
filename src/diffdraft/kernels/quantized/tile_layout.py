"""The int8 kernel's weight layout, shared by every weight class that lays blocks out for it
(``block_linear``, ``gguf_blocks``, ``stacked_blocks``): the formats and ops it numbers, and the tiles of
16 outputs its weights stream in (``int8_matmul.cpp``'s header says what each format's bytes are)."""

from __future__ import annotations

import torch

BLOCK = 32
"""Inputs per block."""
TILE = 16
"""Output columns per tile of the int8 kernel's weight layout: one int32 lane each."""
INT8_FORMATS = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
"""The formats the int8 kernel runs (``block_linear.BlockWeight`` and ``Q8Weight``, then
``gguf_blocks.GGUFBlocks``)."""
STACKED = "stacked"
"""The format name of siblings stacked across formats (``stacked_blocks.StackedBlocks``)."""
INT8_OPS = (*INT8_FORMATS, STACKED)
"""The int8 kernel's ops by format, numbered as ``decoder_loop.cpp`` takes them."""


def float16_bytes(values: torch.Tensor) -> torch.Tensor:
    """Float16-valued ``values`` [out, n] as their float16 bytes [out, n, 2] (low byte first); refuses
    values float16 does not hold, which the kernel could not compute with."""
    half = values.half()
    if not torch.equal(half.float(), values):
        raise ValueError("the int8 kernel keeps scales as float16, and these are not float16 values")
    bits = half.view(torch.int16)
    return torch.stack([bits & 255, bits >> 8 & 255], dim=-1).to(torch.uint8)


def tile_bytes(part: torch.Tensor, group: int) -> torch.Tensor:
    """[out, blocks, width] bytes -> [tiles, blocks, TILE * width]: ``group`` bytes of each output in
    turn, the outputs padded with zero bytes to whole tiles."""
    out, blocks, width = part.shape
    part = torch.nn.functional.pad(part, (0, 0, 0, 0, 0, -out % TILE))
    grouped = part.view(-1, TILE, blocks, width // group, group).permute(0, 2, 3, 1, 4)
    return grouped.reshape(-1, blocks, TILE * width)
