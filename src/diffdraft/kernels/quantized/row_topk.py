"""A draft tree's candidates on the CPU kernel (``row_topk.cpp``): each row's k largest values and
their indices, as ``torch.topk`` gives them, several times sooner.

DDTree ranks the likeliest tokens of every drafted position each round, and on a CPU torch's topk
was most of a round's tree building (docs/decisions.md, "draft candidates on the row-top-k kernel").
"""

from __future__ import annotations

import functools

import torch

from diffdraft.kernels.quantized.kernel_build import block_kernel

MAX_K = 64
"""Largest k the kernel takes: it keeps a sorted list of k per row, inserting into it one by one."""


def top_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., k] of the ``k`` largest of each row of ``scores`` [..., V], largest
    first: ``scores.topk(k, dim=-1)``, equal values in index order (torch leaves their order open), on
    the kernel for CPU float32 rows and k up to :data:`MAX_K` where it runs."""
    on_kernel = scores.device.type == "cpu" and scores.dtype == torch.float32 and 0 < k <= MAX_K
    if not on_kernel or (kernel := _kernel()) is None:  # a GPU run never compiles the CPU library
        top = scores.topk(k, dim=-1)
        return top.values, top.indices
    return kernel(scores.contiguous(), k)


@functools.cache
def _kernel():
    """The op, looked up once (``torch.ops`` attribute lookups cost microseconds per call)."""
    return None if block_kernel() is None else torch.ops.diffdraft_topk.topk_rows
