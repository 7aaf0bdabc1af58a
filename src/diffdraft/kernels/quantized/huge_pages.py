"""The block kernels' weights on transparent huge pages, so a decoding forward stops paying page walks.

A decoding forward on a CPU streams every weight once from memory. With the 4 KB pages torch's
allocator gets, that is one TLB miss per 4 KB read: a page walk, two nested ones in a virtual machine,
and the hardware prefetchers stop at each page's end. Linux backs an anonymous mapping with 2 MB
pages where the mapping asks for them before its pages are touched (``madvise(MADV_HUGEPAGE)``,
honoured in transparent huge pages' default "madvise" mode and in "always"); torch's allocator asks
only under ``THP_MEM_ALLOC_ENABLE`` and only for tensors of 2 MB or more, while the block kernels'
weight tiles are one tensor per projection, most under 2 MB. So once a target is loaded, every tile
the kernels stream is copied into one such mapping and its tensor pointed there in place (every
holder of the tensor, the fused decoder layers' stack included, reads the new storage): the same
bytes, read in fewer pages (docs/decisions.md, "the kernels' weights on huge pages").

Where the platform has no ``MADV_HUGEPAGE`` (not Linux) or the kernel refuses it, nothing moves.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch
from torch import nn

from diffdraft.kernels.fused_projections import ProjectionSlice
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear

HUGE_PAGE = 2 << 20
"""The x86-64 huge page: the mapping's first tensor starts on one."""
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
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if not tensors or advice is None:
        return 0
    sizes = [t.nbytes for t in tensors]
    spans = [-(-size // ALIGNMENT) * ALIGNMENT for size in sizes]
    region = mmap.mmap(-1, sum(spans) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)  # before any page is touched: the pages are huge from their first fault
    except OSError:  # a kernel built without transparent huge pages
        region.close()
        return 0
    arena = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while any tensor reads it
    offset = -arena.data_ptr() % HUGE_PAGE
    storage = arena.untyped_storage()
    with torch.no_grad():
        for tensor, size, span in zip(tensors, sizes, spans, strict=True):
            arena[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
            elements = offset // tensor.element_size()
            tensor.set_(storage, elements, tensor.shape, tensor.stride())
            offset += span
    return sum(sizes)


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
