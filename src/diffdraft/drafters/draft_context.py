"""The context keys and values of a block drafter's layers, one sequence's, in buffers that grow.

Every draft layer attends to the projected target states of all committed tokens. Kept as one tensor
per layer, each round that commits tokens would copy the whole context to append a few rows; here the
rows live in buffers with spare room (doubling when full), so a round writes only its new rows, and the
fused forward writes the block's own keys right after the context and attends over one view.
"""

from __future__ import annotations

import torch

KeysAndValues = tuple[torch.Tensor, torch.Tensor]
"""Keys and values [1, kv_heads, rows, head_dim]."""
INITIAL_ROWS = 256
"""Rows allocated at first: a prompt and some rounds fit before the first doubling."""


class DraftContext:
    """Per draft layer, the keys and values of the context rows so far; empty until the first append."""

    def __init__(self, layer_count: int) -> None:
        self.layer_count = layer_count
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.length = 0

    def append(self, layers: list[KeysAndValues]) -> None:
        """Add the next context rows of every layer (the same count for each)."""
        rows = layers[0][0].shape[2]
        self._reserve(layers[0][0], self.length + rows)
        for keys, values, (new_keys, new_values) in zip(self._keys, self._values, layers, strict=True):
            keys[:, :, self.length : self.length + rows] = new_keys
            values[:, :, self.length : self.length + rows] = new_values
        self.length += rows

    def layers(self) -> list[KeysAndValues]:
        """Every layer's context keys and values, views of the buffers (valid until the next append)."""
        end = self.length
        return [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self._keys, self._values, strict=True)]

    def with_block(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> KeysAndValues:
        """Layer ``layer``'s context followed by a block's own keys and values, written into the spare
        rows past the context (the next block or append overwrites them)."""
        end = self.length + keys.shape[2]
        self._reserve(keys, end)
        self._keys[layer][:, :, self.length : end] = keys
        self._values[layer][:, :, self.length : end] = values
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def block_room(self, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's key and value buffers with room for a block of ``rows`` past the context, for a
        forward that writes the block's keys and values there itself (as :meth:`with_block` does);
        valid until the next append or block. The context must hold rows already."""
        self._reserve(self._keys[0], self.length + rows)
        return self._keys, self._values

    def count_appended(self, rows: int) -> None:
        """Count as context the next ``rows`` rows, which an op wrote into :meth:`block_room`'s buffers
        itself (as :meth:`append` writes them)."""
        self.length += rows

    def _reserve(self, like: torch.Tensor, rows: int) -> None:
        if self._keys and rows <= self._keys[0].shape[2]:
            return
        capacity = max(rows, 2 * self._keys[0].shape[2] if self._keys else INITIAL_ROWS)
        shape = (*like.shape[:2], capacity, like.shape[3])
        old = self._keys + self._values
        self._keys = [like.new_zeros(shape) for _ in range(self.layer_count)]
        self._values = [like.new_zeros(shape) for _ in range(self.layer_count)]
        for kept, grown in zip(old, self._keys + self._values, strict=False):  # none on the first call
            grown[:, :, : self.length] = kept[:, :, : self.length]
