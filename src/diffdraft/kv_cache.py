"""A KV cache that appends in place: no copy of the whole cache per layer and forward.

Hugging Face's ``DynamicLayer`` appends by concatenation, so every forward copies every layer's
whole cache once (60 copies per SmolLM2 forward, each growing with the context), and every
rejected draft is cropped by slicing, only to be copied again by the next append. Speculative
decoding appends and crops every round, so diffdraft's targets keep each layer's keys and values
in a buffer with spare room instead: an append writes the new rows, a crop only shortens the view,
and the buffer grows by a quarter when full. Attention reads the same numbers through a strided view
(identical outputs, tested).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE_ROWS = 256
"""Room left after an append that outgrows the buffer (or a quarter of the cache, if more): growth
is geometric, so appends copy the cache O(1) times on average, and the spare room stays within a
quarter of the cache where memory is tight (long prompts on a GPU)."""


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of the first ``length`` rows of larger
    buffers; writing into the views (as :meth:`TargetModel.keep_path` does) writes the buffers."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, end + max(SPARE_ROWS, end // 4))
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self._key_buffer is not None:
            keys[..., : self._length, :] = self.keys
            values[..., : self._length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (Hugging Face's negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of rows to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._set_length(max(0, self._length + tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._length = 0


def growable_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`GrowableLayer` (sliding
    window layers keep Hugging Face's own, which drop old rows)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
