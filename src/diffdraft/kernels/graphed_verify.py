"""Verification forwards replayed from CUDA graphs: a GPU round without the host's kernel launches.

An eager forward of an 8B target launches thousands of kernels, and the host's launches, not the
token count, set its time; the same forward replayed from a CUDA graph is several times faster
(docs/decisions.md, "GPU verification replayed from CUDA graphs"). A graph replays fixed addresses and
shapes, so the captured forward (:class:`LeanForward`'s, unchanged) differs from the eager one in
two places only:

- new keys and values are written with ``index_copy_`` at cache rows held in a device tensor,
  rather than appended by slicing at a host-side length;
- attention reads each layer's whole buffer (its capacity) under a mask that hides the rows past
  the cache's length, rather than a view of the cached rows.

One graph is captured per (token count, tapped layers) and cache buffer: the shared buffer of
:func:`diffdraft.kernels.kv_cache.growable_cache` is where the keys live, so a new or grown buffer (a new
generation, a longer context) captures again. A forward the buffer has no room for runs eagerly,
which grows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import DynamicCache

from diffdraft.kernels.kv_cache import GrowableLayer
from diffdraft.kernels.lean_forward import LeanForward
from diffdraft.kernels.segment import Segment

T = TypeVar("T")
WARMUP_RUNS = 2
"""Eager runs on a side stream before a capture (CUDA's rule: lazy initialisations must not be
captured)."""


class SlotWriter:
    """The cache as :class:`LeanForward`'s attention sees it inside a graph: ``update`` writes the new
    rows at ``slots`` (a device tensor) and returns the layer's whole buffers."""

    def __init__(self, layers: list[GrowableLayer], slots: torch.Tensor) -> None:
        self.layers = layers
        self.slots = slots

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, ...]:
        layer = self.layers[layer_idx]
        layer._key_buffer.index_copy_(-2, self.slots, keys)
        layer._value_buffer.index_copy_(-2, self.slots, values)
        return layer._key_buffer, layer._value_buffer


@dataclass
class StaticForward:
    """One captured forward: the tensors a replay reads and the ones it writes."""

    token_ids: torch.Tensor
    position_ids: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    """[1, 1, tokens, capacity], additive: the rows of the cache each token sees."""
    run: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """The forward over the tensors above: (logits, taps), overwritten by the next run."""


class GraphedVerify:
    """:meth:`LeanForward.__call__`, replayed from CUDA graphs (see the module docstring).

    ``capture=False`` runs the same static forward eagerly (no graph): the path the tests take on a
    CPU, where graphs do not exist."""

    def __init__(self, lean: LeanForward, capture: bool = True) -> None:
        self.lean = lean
        self.capture = capture
        self.forwards: dict[tuple[int, tuple[int, ...]], StaticForward] = {}
        self.buffer: tuple[int, tuple[int, ...]] | None = None
        """(address, shape) of the cache buffer the forwards were captured on."""

    def __call__(
        self,
        cache: DynamicCache,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        layer_ids: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] and taps [n, T, H], as :meth:`LeanForward.__call__` returns them."""
        layers = cache.layers
        shared = getattr(layers[0], "shared", None)
        length, count = cache.get_seq_length(), token_ids.shape[0]
        end = length + count
        if (
            shared is None
            or shared.layers != layers
            or shared.tensor is None
            or shared.tensor.shape[-2] < end
        ):
            return self.lean(cache, token_ids, position_ids, mask, layer_ids)  # grows the buffer
        buffer = (shared.tensor.data_ptr(), tuple(shared.tensor.shape))
        if buffer != self.buffer:  # the graphs address the old buffer: drop them
            self.forwards.clear()
            self.buffer = buffer
        key = (count, tuple(layer_ids))
        forward = self.forwards.get(key)
        if forward is None:
            forward = self.forwards[key] = self._build(layers, count, layer_ids, length)
        forward.token_ids.copy_(token_ids)
        forward.position_ids.copy_(position_ids)
        forward.slots.copy_(torch.arange(length, end, device=forward.slots.device))
        visible = forward.mask[0, 0]
        visible[:, end:] = torch.finfo(visible.dtype).min
        if mask is None:  # one token: it sees the whole cache and itself
            visible[:, :end] = 0
        else:
            visible[:, :end] = mask[0, 0]
        logits, taps = forward.run()
        for layer in layers:
            layer._length = end
        return logits.clone(), None if taps is None else taps.clone()  # the next run overwrites them

    def _build(
        self, layers: list[GrowableLayer], count: int, layer_ids: list[int], length: int
    ) -> StaticForward:
        """The static inputs for ``count`` tokens, and the forward over them captured (or not)."""
        buffer = layers[0]._key_buffer
        device, capacity = buffer.device, buffer.shape[-2]
        token_ids = torch.zeros(count, dtype=torch.long, device=device)
        position_ids = torch.arange(length, length + count, device=device)
        slots = position_ids.clone()  # warm-up writes land in the rows this forward fills anyway
        mask = torch.zeros(1, 1, count, capacity, dtype=self.lean.model.dtype, device=device)
        writer = SlotWriter(layers, slots)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.lean.packed([Segment(writer, count, mask)], token_ids, position_ids, layer_ids)[0]

        return StaticForward(token_ids, position_ids, slots, mask, captured(run) if self.capture else run)


def captured(run: Callable[[], T]) -> Callable[[], T]:
    """``run`` captured as a CUDA graph, after warm-up runs on a side stream; the call returned
    replays it and returns the captured outputs, which the next replay overwrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own memory pool: graphs replay in any order
        outputs = run()

    def replay() -> T:
        graph.replay()
        return outputs

    return replay
