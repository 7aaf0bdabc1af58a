"""The CPU's feature flags as Linux names them, for what torch's own probes do not tell."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first CPU ("avx2", "avx_vnni", ...); empty where there is no such file
    (another OS), so a caller asking for a feature there goes without it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
