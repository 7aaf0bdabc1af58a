"""Greedy decoding's pick on the CPU kernel (``row_argmax.cpp``): the same index as
:func:`~diffdraft.runtime.sampling.greedy_tokens`, several times sooner.

Every verified tree node needs its row's argmax over the vocabulary; torch's reduction reads a row
one element at a time, a visible share of a round for a tree of a dozen nodes (docs/decisions.md,
"greedy picks on the row-argmax kernel").
"""

from __future__ import annotations

import functools

import torch

from diffdraft.kernels.quantized.kernel_build import block_kernel
from diffdraft.runtime.sampling import greedy_tokens

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension ([..., V] -> [...]), first index on ties (NaN first where a
    row holds one): :func:`greedy_tokens`, on the kernel for CPU float32 and bfloat16 logits where it
    runs."""
    # the device first: asking for the kernel compiles the CPU library, which a GPU run never needs
    if logits.device.type != "cpu" or logits.dtype not in KERNEL_DTYPES or (kernel := _kernel()) is None:
        return greedy_tokens(logits)
    return kernel(logits.contiguous())


@functools.cache
def _kernel():
    """The op, looked up once (``torch.ops`` attribute lookups cost microseconds per call)."""
    return None if block_kernel() is None else torch.ops.diffdraft_argmax.argmax_rows
