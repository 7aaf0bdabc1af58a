"""llama.cpp's own binaries, for the tests that run an exported drafter in llama.cpp."""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_CPP_BIN = Path(
    os.environ.get(
        "DIFFDRAFT_LLAMA_CPP_BIN",
        "/work/bench/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/build-noamx/bin",
    )
)
"""Where llama.cpp's binaries are (built from the llama-cpp-python sdist's vendored source)."""
