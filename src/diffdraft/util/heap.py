"""Keep memory a process frees in its heap (glibc), so training's large per-step tensors reuse pages.

A CPU training step allocates and frees hundreds of megabytes (the target's logits and features, the
drafter's activations and gradients). With glibc's defaults the freed top of the heap is handed back
to the kernel and the next step faults every page in again, zeroed, which costs every step time in the
kernel (docs/decisions.md, "Training keeps freed memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_CEILING = 32 << 20
"""glibc's largest mmap threshold on 64-bit machines: allocations above it are always mapped anew."""
_TRIM_THRESHOLD = (1 << 31) - 1
"""Free memory the heap may keep at its top before trimming (mallopt takes a C int): the whole of a
step's working set stays mapped between steps."""
_TOP_PAD = 256 << 20
"""Extra heap grown at a time, so a step's growth takes a few calls instead of many."""


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep what is freed for reuse rather than return it to the kernel.

    The peak stays what it was (a step's tensors are freed and allocated again at the same sizes), but
    the process holds it until it exits, as a training run holds it anyway. Returns whether
    glibc took every setting; False where the C library is not glibc (macOS, musl, Windows), which
    changes nothing else."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    settings = {
        _M_MMAP_THRESHOLD: _MMAP_THRESHOLD_CEILING,
        _M_TRIM_THRESHOLD: _TRIM_THRESHOLD,
        _M_TOP_PAD: _TOP_PAD,
    }
    taken = [mallopt(option, value) == 1 for option, value in settings.items()]  # each, even after a refusal
    return all(taken)
