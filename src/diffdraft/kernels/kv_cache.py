"""A KV cache that appends in place: no copy of the whole cache per layer and forward.

Hugging Face's ``DynamicLayer`` appends by concatenation, so every forward copies every layer's
whole cache once (60 copies per SmolLM2 forward, each growing with the context), and every
rejected draft is cropped by slicing, only to be copied again by the next append. Speculative
decoding appends and crops every round, so diffdraft's targets keep each layer's keys and values
in a buffer with spare room instead: an append writes the new rows, a crop only shortens the view,
and the buffer grows by a quarter when full. Attention reads the same numbers through a strided view
(identical outputs, tested). All layers' buffers are slices of one tensor, so moving the accepted
rows of a verified tree into place (:func:`keep_rows`) is one gather and one write for the whole
model rather than four small copies per layer.
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from diffdraft.kernels.huge_pages import huge_page_zeros

SPARE_ROWS = 256
"""Room left after an append that outgrows the buffer (or a quarter of the cache, if more): growth
is geometric, so appends copy the cache O(1) times on average, and the spare room stays within a
quarter of the cache where memory is tight (long prompts on a GPU)."""


class SharedBuffer:
    """Keys and values of every layer in one tensor [layers, 2, batch, heads, capacity, head_dim];
    each :class:`GrowableLayer` built on it joins :attr:`layers` in cache order.

    The layers hold the buffer and the buffer only weak references to them: a reference cycle
    would leave a finished sequence's cache (its whole buffer) to the cyclic garbage collector,
    which in a process holding many objects runs seldom: caches of every earlier generation were
    found still alive.
    """

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self._layers: list[weakref.ref[GrowableLayer]] = []

    @property
    def layers(self) -> list[GrowableLayer]:
        return [layer for ref in self._layers if (layer := ref()) is not None]

    def join(self, layer: GrowableLayer) -> None:
        self._layers.append(weakref.ref(layer))

    def reserve(self, rows: int) -> int | None:
        """Room in every layer for ``rows`` more rows, for an op that writes them into :attr:`tensor` in
        place (then :meth:`extend`); returns the rows every layer holds (None before the layers'
        first append: no buffer yet, and :meth:`GrowableLayer.update` makes it)."""
        layers = self.layers
        if self.tensor is None or not all(layer.is_initialized for layer in layers):
            return None
        held = layers[0].get_seq_length()
        if held + rows > self.tensor.shape[-2]:
            self.grow(layers[0].keys, _capacity_for(held + rows))
        return held

    def extend(self, rows: int) -> None:
        """Count ``rows`` more rows in every layer: the rows :meth:`reserve` made room for, written."""
        layers = self.layers
        self._set_length(layers, layers[0].get_seq_length() + rows)

    def crop(self, rows: int) -> None:
        """Drop every layer's last ``rows`` rows (what ``DynamicCache.crop(-rows)`` does, in one go)."""
        layers = self.layers
        self._set_length(layers, max(0, layers[0].get_seq_length() - rows))

    @staticmethod
    def _set_length(layers: list[GrowableLayer], length: int) -> None:
        for layer in layers:
            layer._length = length

    def grow(self, like: torch.Tensor, capacity: int) -> None:
        """Reallocate with room for ``capacity`` rows, keeping every layer's rows. Zeroed: a forward
        replayed from a CUDA graph (:mod:`diffdraft.kernels.graphed_verify`) reads every row under a mask, and
        a mask does not hide the NaN that uninitialised memory can hold."""
        layers = self.layers
        shape = (len(layers), 2, *like.shape[:-2], capacity, like.shape[-1])
        # attention streams the cache as a forward streams the weights: on huge pages where it fills one
        tensor = huge_page_zeros(shape, like.dtype) if like.device.type == "cpu" else None
        if tensor is None:
            tensor = like.new_zeros(shape)
        if self.tensor is not None:
            kept = max(layer.get_seq_length() for layer in layers)
            tensor[..., :kept, :] = self.tensor[..., :kept, :]
        self.tensor = tensor
        for index, layer in enumerate(layers):
            layer._key_buffer, layer._value_buffer = tensor[index, 0], tensor[index, 1]


class _LeadingRows:
    """A :class:`GrowableLayer`'s ``keys`` or ``values``: the first rows of its buffer, viewed when read,
    so an append or a crop only counts rows: every layer's views made anew, twice a round, were a
    visible share of a sequence's round (docs/decisions.md, "cache views made when read"). Before the
    layer has a buffer, what Hugging Face's code assigned (None, an empty tensor)."""

    def __init__(self, buffer: str) -> None:
        self.buffer = buffer

    def __set_name__(self, owner: type, name: str) -> None:
        self.unbuffered = f"_unbuffered_{name}"

    def __get__(self, layer: GrowableLayer | None, owner: type | None = None):
        if layer is None:
            return self
        buffer = getattr(layer, self.buffer)
        return getattr(layer, self.unbuffered) if buffer is None else buffer[..., : layer._length, :]

    def __set__(self, layer: GrowableLayer, tensor: torch.Tensor | None) -> None:
        setattr(layer, self.unbuffered, tensor)


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views of the first ``length`` rows of larger
    buffers (its own, or its slice of a :class:`SharedBuffer`); writing into the views (as
    :func:`keep_rows` does) writes the buffers."""

    keys = _LeadingRows("_key_buffer")
    values = _LeadingRows("_value_buffer")

    def __init__(self, shared: SharedBuffer | None = None) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = 0
        super().__init__()
        self.shared = shared
        if shared is not None:
            shared.join(self)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, _capacity_for(end))
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._length = end
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        if self.shared is not None:
            self.shared.grow(key_states, capacity)
            return
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self._key_buffer is not None:
            keys[..., : self._length, :] = self.keys
            values[..., : self._length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    @property
    def capacity(self) -> int:
        """Rows the buffers hold before the next append has to grow them."""
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (Hugging Face's negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of rows to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self._length = max(0, self._length + tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._length = 0
        if self.shared is not None:
            self.shared.tensor = None


def _capacity_for(rows: int) -> int:
    """The capacity a buffer grows to when ``rows`` outgrow it (see :data:`SPARE_ROWS`)."""
    return rows + max(SPARE_ROWS, rows // 4)


def shared_buffer(cache: DynamicCache) -> SharedBuffer | None:
    """The buffer holding every layer of ``cache`` (:func:`growable_cache`'s), or None."""
    shared = getattr(cache.layers[0], "shared", None) if cache.layers else None
    return shared if shared is not None and shared.layers == cache.layers else None


def growable_cache(config, shared: bool = True) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose attention layers are :class:`GrowableLayer`, sliding-window
    layers too: Hugging Face's sliding layers drop the rows that leave the window, and a rejected draft
    could not be cropped back from them, so the window is the mask's instead
    (:mod:`diffdraft.kernels.attention_window`). Other kinds of layer (linear attention's) stay as they
    are. ``shared``: when every layer has the same head count, their rows live in one
    :class:`SharedBuffer`."""
    cache = DynamicCache(config=config)
    growable = [type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers]
    uniform = isinstance(getattr(config, "num_key_value_heads", None), int)  # not a per-layer list
    buffer = SharedBuffer() if shared and uniform and all(growable) else None
    cache.layers = [
        GrowableLayer(buffer) if grows else layer for layer, grows in zip(cache.layers, growable, strict=True)
    ]
    return cache


def keep_rows(cache: DynamicCache, start: int, path: list[int]) -> None:
    """Move cache rows ``start + path[i]`` to ``start + i`` in every layer (``path`` increasing)."""
    source = torch.tensor(path, device=cache.layers[0].keys.device) + start
    shared = shared_buffer(cache)
    if shared is not None:
        rows = shared.tensor.index_select(-2, source)
        shared.tensor[..., start : start + len(path), :] = rows
        return
    for layer in cache.layers:
        layer.keys[:, :, start : start + len(path)] = layer.keys.index_select(2, source)
        layer.values[:, :, start : start + len(path)] = layer.values.index_select(2, source)
