"""Where diffdraft keeps what it builds once per machine (the converted default target, compiled
kernels, measured cost curves, the default n-gram trie): one root, so one variable moves all of it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$DIFFDRAFT_CACHE``, else ``$XDG_CACHE_HOME/diffdraft``, else ``~/.cache/diffdraft``."""
    if os.environ.get("DIFFDRAFT_CACHE"):
        return Path(os.environ["DIFFDRAFT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "diffdraft"
