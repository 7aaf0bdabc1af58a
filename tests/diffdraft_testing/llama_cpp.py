"""llama.cpp's own binaries, for the tests that run an exported drafter in llama.cpp: found through
``$DIFFDRAFT_LLAMA_CPP_BIN`` or ``PATH``, never at a path of one machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

BIN_VARIABLE = "DIFFDRAFT_LLAMA_CPP_BIN"
"""Names the folder of llama.cpp's binaries (its ``build/bin``); without it they are looked up on PATH."""


def llama_cpp_binary(name: str) -> Path:
    """The llama.cpp binary ``name`` (e.g. ``llama-speculative-simple``) in ``$DIFFDRAFT_LLAMA_CPP_BIN``
    or, without that variable, on PATH; the calling test skips, saying how to make it run, if none is."""
    folder = os.environ.get(BIN_VARIABLE)
    found = Path(folder, name) if folder else shutil.which(name)
    if found is None or not Path(found).is_file():
        where = f"in {BIN_VARIABLE}={folder}" if folder else "on PATH"
        pytest.skip(f"no {name} {where}: build llama.cpp and put its bin folder on PATH or in {BIN_VARIABLE}")
    return Path(found)
