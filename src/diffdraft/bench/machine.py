"""What a benchmark ran on, for its report: timings mean little without the machine's name."""

from __future__ import annotations

import platform
from pathlib import Path

from diffdraft.util.cpu_flags import cpu_flags


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SPEED_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "avx_vnni",
)
"""The CPU features that decide which kernels run and how fast: a timing means little without them
(the same methods ran 0.5-0.8x plain decoding on a Xeon without AVX-512 BF16 and 1.3-2.5x on one
with it)."""


def cpu_description() -> dict:
    """The CPU's model name and which of :data:`SPEED_FLAGS` it has, from /proc/cpuinfo."""
    flags = cpu_flags()
    return {"model": cpu_name(), "flags": {flag: flag in flags for flag in SPEED_FLAGS}}
