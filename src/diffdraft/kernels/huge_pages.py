"""What a forward streams, on transparent huge pages: the block kernels' weights and the KV cache.

A decoding forward on a CPU streams every weight once from memory, and attention the whole KV cache.
With the 4 KB pages torch's allocator gets, that is one TLB miss per 4 KB read: a page walk, two
nested ones in a virtual machine, and the hardware prefetchers stop at each page's end. Linux backs
an anonymous mapping with 2 MB pages where the mapping asks for them before its pages are touched
(``madvise(MADV_HUGEPAGE)``, honoured in transparent huge pages' default "madvise" mode and in
"always"); torch's allocator asks only under ``THP_MEM_ALLOC_ENABLE`` and only for tensors of 2 MB or
more, while the block kernels' weight tiles are one tensor per projection, most under 2 MB. So once a
target is loaded, every tile the kernels stream is copied into one such mapping and its tensor
pointed there in place (every holder of the tensor, the fused decoder layers' stack included, reads
the new storage), and a CPU KV cache of a huge page or more is allocated in one: the same bytes, read
in fewer pages (docs/decisions.md, "what a forward streams, on huge pages").

Where the platform has no ``MADV_HUGEPAGE`` (not Linux) or the kernel refuses it, nothing changes.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from diffdraft.kernels.fused_projections import ProjectionSlice
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear

HUGE_PAGE = 2 << 20
"""The x86-64 huge page: a mapping's first tensor starts on one, and a smaller cache is left alone."""
ALIGNMENT = 4096
"""Each further tensor starts on a 4 KB page: what the kernels' prefetch and tiles are laid out for is
a fraction of that, and no tensor shares a page with the next."""


def block_weights_on_huge_pages(*models: nn.Module) -> int:
    """Move the weight tiles of the block-quantized layers in ``models`` (stacked q|k|v and gate|up
    projections included) into one huge-page mapping; returns the bytes moved (0 where nothing moved:
    no such layers, another device, or no huge pages on this platform)."""
    return move_to_huge_pages(_streamed_tensors(models))


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy each of ``tensors`` (contiguous CPU tensors, each once; others are left) into one anonymous
    mapping advised for huge pages, and point the tensor at its copy in place. A view of the old
    storage made before keeps reading it, which is freed once nothing holds it, the mapping once no
    tensor does. Returns the bytes moved."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous() and t.numel()]
    sizes = [t.nbytes for t in tensors]
    spans = [-(-size // ALIGNMENT) * ALIGNMENT for size in sizes]
    arena = _huge_page_bytes(sum(spans)) if tensors else None
    if arena is None:
        return 0
    storage, base, position = arena.untyped_storage(), arena.storage_offset(), 0
    with torch.no_grad():
        for tensor, size, span in zip(tensors, sizes, spans, strict=True):
            arena[position : position + size].copy_(tensor.reshape(-1).view(torch.uint8))
            tensor.set_(storage, (base + position) // tensor.element_size(), tensor.shape, tensor.stride())
            position += span
    return sum(sizes)


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
    """A zeroed CPU tensor of ``shape`` in a mapping of its own advised for huge pages (a fresh
    mapping reads as zeros: the kernel clears each page at its first touch, as ``torch.zeros`` would
    have); None where it would be under a huge page or the platform has none."""
    nbytes = math.prod(shape) * dtype.itemsize
    arena = _huge_page_bytes(nbytes) if nbytes >= HUGE_PAGE else None
    return None if arena is None else arena[:nbytes].view(dtype).view(*shape)


def _huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of a fresh anonymous mapping advised for huge pages, starting on one, as a uint8
    tensor that holds the mapping for as long as any tensor views it; None where the platform has no
    ``MADV_HUGEPAGE`` or its kernel refuses it."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)  # before any page is touched: the pages are huge from their first fault
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _streamed_tensors(models: Iterable[nn.Module]) -> list[torch.Tensor]:
    """The tensors the block-quantized layers in ``models`` hand their kernels, each once, whole
    storages only (a tensor that views part of a storage shares it with another, which a move would
    split)."""
    layers = {}
    for module in (module for model in models for module in model.modules()):
        if isinstance(module, ProjectionSlice):
            module = module.stacked.linear
        if isinstance(module, BlockQuantizedLinear):
            layers[id(module)] = module
    seen, tensors = set(), []
    for layer in layers.values():
        for tensor in layer.kernel_tensors():
            whole = tensor.storage_offset() == 0 and tensor.nbytes == tensor.untyped_storage().nbytes()
            if whole and tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                tensors.append(tensor)
    return tensors
