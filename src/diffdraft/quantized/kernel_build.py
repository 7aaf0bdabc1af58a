"""Compile the Q4_1 matmul (``q4_1_matmul.cpp``) and the fused decoder-layer ops (``decoder_ops.cpp``)
once per machine into one library and load it into torch.

The kernel needs AVX-512 with the bfloat16 dot product and a C++ compiler; it is compiled against the
installed torch on first use (about 20 s) into the diffdraft cache, keyed by the source, torch version
and compiler flags, so later processes just load it. Where it cannot run, callers keep dense weights.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.utils.cpp_extension

from diffdraft.default_model import cache_root
from diffdraft.staging import temp_dir_beside

SOURCE = Path(__file__).with_name("q4_1_matmul.cpp")
DECODER_SOURCE = Path(__file__).with_name("decoder_ops.cpp")
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mfma"]  # fmt: skip
"""No -march=native: the cached library must not use instructions of the machine that compiled it
beyond those :func:`cpu_supported` checks."""


def cpu_supported() -> bool:
    """Whether this CPU runs the kernel: AVX-512 with the bfloat16 dot product (Zen 4, Sapphire Rapids)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


@functools.cache
def block_kernel() -> object | None:
    """``torch.ops.diffdraft_blocks``, compiling it first if needed; None (with one stderr line saying
    why) where the CPU or the toolchain cannot run it."""
    if not cpu_supported():
        return None
    library = _library_path()
    if not library.is_file():
        try:
            _compile(library)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            print(
                f"diffdraft: cannot build the quantized CPU kernel ({detail.strip().splitlines()[-1:]}); "
                "keeping dense weights. Install a C++ compiler (g++ 12 or newer) for the faster path.",
                file=sys.stderr,
            )
            return None
    torch.ops.load_library(str(library))
    return torch.ops.diffdraft_blocks


def _library_path() -> Path:
    sources = [path.read_bytes() for path in _sources()]
    key = hashlib.sha1(
        b"\0".join([*sources, torch.__version__.encode(), " ".join(FLAGS).encode()])
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"q4_1_matmul-{key}.so"


def _sources() -> tuple[Path, Path]:
    """Read at call time, so a test can swap one."""
    return SOURCE, DECODER_SOURCE


def _compile(library: Path) -> None:
    """Compile into a temp dir beside the cache entry, then rename: a concurrent or killed build never
    leaves a half-written library behind."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler found (looked for $CXX, g++, c++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(library)
    try:
        includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
        libraries = [f"-L{path}" for path in torch.utils.cpp_extension.library_paths()]
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        built = tmp / library.name
        linked = [*libraries, "-lc10", "-ltorch_cpu"]
        command = [compiler, *FLAGS, abi, *includes, *map(str, _sources()), *linked, "-o", str(built)]
        print("diffdraft: compiling the quantized CPU kernel (once, ~20 s) ...", file=sys.stderr)
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(built, library)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
