"""A weight kept in the bytes of a GGUF tensor of the formats llama.cpp's common mixes use beyond Q4_1 and
Q8_0 (which have classes of their own in ``block_linear.py``): Q4_0, Q5_0, Q4_K, Q5_K and Q6_K.

The GGUF bytes are the weight: rows and stacks move them, and ``dequantize`` is the ``gguf`` package's
own, so a layer's dense weight is exactly what transformers read from the file. ``tiles`` unpacks each
block's integer codes and scales (the layouts are llama.cpp's: ``ggml-common.h`` there) and lays them out
for ``int8_matmul.cpp``, whose header says what each format's codes, zero points and per-column values
are. Every value the kernel multiplies by is an exact product of the file's numbers (a float16 times a
6- or 8-bit integer), so the kernel computes the file's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from diffdraft.kernels.quantized.tile_layout import BLOCK, float16_bytes, tile_bytes

GGUF_FORMATS = ("Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
"""The formats this class holds (Q4_1 and Q8_0 are ``BlockWeight`` and ``Q8Weight``)."""
SUPER_BLOCK = 256
"""Inputs per K-format super-block: its d (and dmin) serve eight blocks of 32."""


@dataclass
class GGUFBlocks:
    """A weight [out, in] as the GGUF tensor's bytes, uint8 [out, bytes per row] (each row its own run
    of blocks, as GGUF stores them), in ``format`` (one of :data:`GGUF_FORMATS`). The bytes stay where
    they were given, usually the file's read-only memory map, and a stack keeps its pieces apart (``raws``):
    only the kernel's tiles are copied, so a big model's layers take no second copy of the file."""

    raws: tuple[np.ndarray, ...]
    format: str

    @classmethod
    def from_gguf(cls, raw: np.ndarray, format: str) -> GGUFBlocks:
        if format not in GGUF_FORMATS:
            raise ValueError(f"GGUFBlocks holds {GGUF_FORMATS}; got {format}")
        return cls((np.asarray(raw, dtype=np.uint8),), format)

    @property
    def raw(self) -> np.ndarray:
        """The bytes of every row, one array."""
        return self.raws[0] if len(self.raws) == 1 else np.concatenate(self.raws)

    @property
    def _sizes(self) -> tuple[int, int]:
        """(inputs, bytes) per GGUF block of the format."""
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.format]]

    @property
    def out_features(self) -> int:
        return sum(raw.shape[0] for raw in self.raws)

    @property
    def in_features(self) -> int:
        inputs, size = self._sizes
        return self.raws[0].shape[1] // size * inputs

    def rows(self, index: torch.Tensor) -> GGUFBlocks:
        """The weight's rows ``index``, in that order (a copy)."""
        return GGUFBlocks((np.ascontiguousarray(self.raw[index.numpy()]),), self.format)

    @staticmethod
    def stack(weights: list[GGUFBlocks]) -> GGUFBlocks:
        """The weights' rows one after another (they share a format and input width)."""
        return GGUFBlocks(tuple(raw for w in weights for raw in w.raws), weights[0].format)

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight, by the ``gguf`` package (as transformers reads the file)."""
        values = quants.dequantize(self.raw, GGMLQuantizationType[self.format])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def codes_and_values(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The unsigned integer codes uint8 [out, in] and the per-block values of
        ``int8_matmul.cpp``'s table: for Q4_0 / Q5_0 ``d`` [out, in / 32]; for Q4_K / Q5_K ``d``,
        ``dmin`` [out, in / 256] and ``sc``, ``m`` [out, in / 32]; for Q6_K ``d`` [out, in / 256] and
        ``sc`` [out, in / 16] (int8)."""
        size = self._sizes[1]
        blocks = self.raw.reshape(self.out_features, -1, size)
        return _UNPACK[self.format](blocks)

    def tiles(self) -> torch.Tensor:
        """``int8_matmul.cpp``'s layout: uint8 [tiles, groups, bytes], a group being a block of 32
        inputs, or eight behind their super-block's header for the K formats."""
        codes, values = self.codes_and_values()
        out = self.out_features
        blocks = codes.reshape(out, -1, BLOCK)
        parts = [_nibbles(blocks)]
        if self.format in ("Q5_0", "Q5_K"):
            parts.append(_bit_plane(blocks, 4, 1))
        elif self.format == "Q6_K":
            parts += [_bit_plane(blocks[..., :16], 4, 2), _bit_plane(blocks[..., 16:], 4, 2)]
        if self.format in ("Q4_0", "Q5_0"):
            parts.append(_halves(values["d"]))
            return torch.cat(parts, dim=-1).contiguous()
        if self.format == "Q6_K":
            sc = values["sc"].reshape(out, -1, 2)  # the scales of each block's two halves
            parts += [_bytes(sc[..., 0]), _bytes(sc[..., 1])]
            header = [_halves(values["d"])]
        else:
            parts += [_bytes(values["sc"]), _bytes(values["m"])]
            header = [_halves(values["d"]), _halves(-values["dmin"])]
        per_block = torch.cat(parts, dim=-1)
        grouped = per_block.reshape(per_block.shape[0], -1, SUPER_BLOCK // BLOCK * per_block.shape[2])
        return torch.cat([*header, grouped], dim=-1).contiguous()


def _nibbles(blocks: np.ndarray) -> torch.Tensor:
    """The low four bits of each code, byte k of a block holding input k (low) and k + 16 (high)."""
    low = blocks[..., :16] & 15
    packed = low | (blocks[..., 16:] & 15) << 4
    return tile_bytes(torch.from_numpy(np.ascontiguousarray(packed)), 4)


def _bit_plane(halves: np.ndarray, shift: int, bits: int) -> torch.Tensor:
    """Bits ``shift`` .. ``shift + bits - 1`` of codes [out, blocks, width] as bytes [out, blocks, 4]:
    byte i holds, from bit ``bits * j`` on, those of code 4j + i (for j = 0 .. width / 4 - 1)."""
    out, count, width = halves.shape
    top = ((halves >> shift) & ((1 << bits) - 1)).astype(np.uint8).reshape(out, count, width // 4, 4)
    plane = np.zeros((out, count, 4), dtype=np.uint8)
    for j in range(width // 4):
        plane |= top[:, :, j] << (bits * j)
    return tile_bytes(torch.from_numpy(plane), 4)


def _halves(values: np.ndarray) -> torch.Tensor:
    """Per-column float16 values [out, n] in the tiles' layout [tiles, n, 32]."""
    return tile_bytes(float16_bytes(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))), 2)


def _bytes(values: np.ndarray) -> torch.Tensor:
    """Per-column bytes [out, n] (unsigned or int8) in the tiles' layout [tiles, n, 16]."""
    return tile_bytes(torch.from_numpy(np.ascontiguousarray(values).view(np.uint8)[..., None]), 1)


def _float16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray, count: int) -> np.ndarray:
    """Nibbles [out, n, count * 16 bytes] -> codes [out, n, count * 32]: each run of 32 bytes (16 for
    the 32-input formats) holds one run of inputs in its low nibbles and the next in its high ones."""
    out, n, size = qs.shape
    runs = qs.reshape(out, n, count, size // count)
    return np.stack([runs & 15, runs >> 4], axis=3).reshape(out, n, -1)


def _unpack_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    codes = _low_high(blocks[..., 2:18], 1)
    return codes.reshape(blocks.shape[0], -1), {"d": _float16(blocks, 0)}


def _unpack_q5_0(blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    fifth = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit k: that of input k
    codes = _low_high(blocks[..., 6:22], 1) | fifth << 4
    return codes.reshape(blocks.shape[0], -1), {"d": _float16(blocks, 0)}


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's twelve bytes of 6-bit scales and mins -> sc, m [out, n, 8]: bytes 0-3 hold the
    low six bits of sc 0-3, bytes 4-7 those of m 0-3; sc and m 4-7 take their low four bits from bytes
    8-11 (low and high nibble) and their top two from the top bits of bytes 0-3 and 4-7."""
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([first & 63, (rest & 15) | (first >> 6) << 4], axis=-1)
    m = np.concatenate([second & 63, (rest >> 4) | (second >> 6) << 4], axis=-1)
    return sc, m


def _unpack_k_with_mins(blocks: np.ndarray, fifth: np.ndarray | None) -> tuple[np.ndarray, dict]:
    out = blocks.shape[0]
    sc, m = _k_scales(blocks[..., 4:16])
    codes = _low_high(blocks[..., -128:], 4)
    if fifth is not None:  # bit b of byte i: that of input 32b + i
        bits = np.unpackbits(fifth[..., None], axis=-1, bitorder="little")  # [out, n, 32, 8]
        codes = codes | bits.transpose(0, 1, 3, 2).reshape(codes.shape) << 4
    values = {
        "d": _float16(blocks, 0),
        "dmin": _float16(blocks, 2),
        "sc": sc.reshape(out, -1),
        "m": m.reshape(out, -1),
    }
    return codes.reshape(out, -1), values


def _unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, dict]:
    """Q6_K: per 128 inputs, 64 bytes of nibbles (inputs i and 64 + i) and 32 of top bits (bits 2k,
    2k + 1 of byte i: input 32k + i); then 16 int8 scales, each of 16 inputs, and a float16 d."""
    out, n, _ = blocks.shape
    low = _low_high(blocks[..., :128], 2).reshape(out, n, 2, 128)
    top = blocks[..., 128:192].reshape(out, n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    codes = low | (top & 3).reshape(out, n, 2, 128) << 4
    values = {"d": _float16(blocks, 208), "sc": blocks[..., 192:208].copy().view(np.int8).reshape(out, -1)}
    return codes.reshape(out, -1), values


_UNPACK = {
    "Q4_0": _unpack_q4_0,
    "Q5_0": _unpack_q5_0,
    "Q4_K": lambda blocks: _unpack_k_with_mins(blocks, None),
    "Q5_K": lambda blocks: _unpack_k_with_mins(blocks, blocks[..., 16:48]),
    "Q6_K": _unpack_q6_k,
}
