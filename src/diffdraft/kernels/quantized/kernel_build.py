"""Compile the block-quantized matmuls (``int8_matmul.cpp``, ``q4_1_matmul.cpp``), the fused
decoder-layer ops (``decoder_ops.cpp``) and their loop over the layers (``decoder_loop.cpp``), the
greedy pick (``row_argmax.cpp``) and the rows' top k (``row_topk.cpp``) once per machine into one
library and load it into torch.

The kernels are written in AVX-512 intrinsics (with the bfloat16 and the int8 (VNNI) dot products);
``avx512_subset.h`` makes the bfloat16 ones of other AVX-512 instructions on a CPU without them, and
emulates each intrinsic with AVX2 on a CPU without AVX-512 or VNNI, so every x86-64 CPU of the last
decade runs them (:data:`ISA_FLAGS`). They are compiled against the installed torch on first use
(1 to 4 minutes on 2 cores, a progress line as each source is done) into the diffdraft cache, keyed
by the sources, torch version and compiler flags, so later processes just load them, once the
library's digest matches the one recorded when it was built (:mod:`diffdraft.util.cache_digest`): a
truncated or damaged library is compiled again, never loaded (loading one can die of a bus error).
Where they cannot run, callers keep dense weights.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
import torch.utils.cpp_extension

from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import intact, sealed_file
from diffdraft.util.cpu_flags import cpu_flags
from diffdraft.util.progress import progress_bar
from diffdraft.util.staging import temp_dir_beside

SOURCE = Path(__file__).with_name("q4_1_matmul.cpp")
INTRINSICS = Path(__file__).with_name("avx512_subset.h")
INT8_SOURCE = Path(__file__).with_name("int8_matmul.cpp")
DECODER_SOURCE = Path(__file__).with_name("decoder_ops.cpp")
LOOP_SOURCE = Path(__file__).with_name("decoder_loop.cpp")
ARGMAX_SOURCE = Path(__file__).with_name("row_argmax.cpp")
TOPK_SOURCE = Path(__file__).with_name("row_topk.cpp")
COMMON_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fopenmp"]
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"],
    "avx512-vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"],
    "avx2-vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-ffp-contract=off", "-Wno-psabi"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-Wno-psabi"],
}
"""Per instruction set the kernels are built for, widest first. No -march=native: the cached library
must not use instructions of the machine that compiled it beyond those :func:`instruction_set`
checks. "avx512-vnni" is "avx512" less its bfloat16 instructions, which avx512_subset.h makes of others
with the same results; "avx2-vnni" is the AVX2 build with AVX-VNNI's 256-bit int8 dot product in place of
its emulation. The AVX2 builds keep a multiply and an add apart as the AVX-512 intrinsics do."""

ISA_VARIABLE = "DIFFDRAFT_KERNEL_ISA"
"""Set to a narrower build than this CPU's best ("avx512-vnni", "avx2-vnni" or "avx2") to build and run it
on a wider CPU: the tests check every build that way, and the benchmarks measure what a narrower CPU runs."""


def instruction_set() -> str | None:
    """The widest build this CPU runs, or the narrower one :data:`ISA_VARIABLE` asks for: "avx512" with
    AVX-512's bfloat16 and int8 (VNNI) dot products (Zen 4, Sapphire Rapids), "avx512-vnni" with VNNI
    but no bfloat16 ones (Cascade Lake, Ice Lake), "avx2-vnni" with AVX2 and AVX-VNNI but no AVX-512 (Intel
    cores since Alder Lake, Xeon 6 E-cores), "avx2" on any other CPU with AVX2 (with FMA and F16C, which
    every AVX2 CPU has, and AVX-512 without VNNI: Skylake-SP), else None."""
    asked = os.environ.get(ISA_VARIABLE, "")
    available = _available_builds()
    if not asked:
        return available[0] if available else None
    if asked not in ISA_FLAGS:
        raise ValueError(
            f"${ISA_VARIABLE} may only be one of {', '.join(ISA_FLAGS)} (or unset, for this CPU's best); "
            f"got {asked!r}"
        )
    if asked not in available:
        raise ValueError(
            f"${ISA_VARIABLE}={asked} asks for instructions this CPU lacks; it runs "
            f"{', '.join(available) or 'none of the builds'}: unset it or ask for one of those"
        )
    return asked


def _available_builds() -> list[str]:
    """The builds this CPU can run, widest first (from torch's own CPU probes)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return []
    probes = {name: getattr(torch.cpu, f"_is_{name}_supported", None) for name in ("avx512_bf16", "vnni")}
    has = {name: probe is not None and probe() for name, probe in probes.items()}
    builds = ["avx2"]
    if "avx_vnni" in cpu_flags():  # torch has no probe for it
        builds.insert(0, "avx2-vnni")
    if capability == "AVX512" and has["vnni"]:
        builds.insert(0, "avx512-vnni")
        if has["avx512_bf16"]:
            builds.insert(0, "avx512")
    return builds


def flags() -> list[str]:
    """The compiler flags of this CPU's build (:func:`instruction_set`)."""
    return COMMON_FLAGS + ISA_FLAGS[instruction_set() or "avx512"]


def cpu_supported() -> bool:
    """Whether this CPU runs the kernels (:func:`instruction_set`)."""
    return instruction_set() is not None


@functools.cache
def block_kernel() -> object | None:
    """``torch.ops.diffdraft_blocks``, compiling it first where the cache holds no intact library; None
    (with one stderr line saying why) where the CPU or the toolchain cannot run it."""
    if not cpu_supported():
        return None
    library = _library_path()
    if not intact(library, "the cached quantized CPU kernel", "compiling it again"):
        try:
            _compile(library)
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"diffdraft: cannot build the quantized CPU kernel: {_why(error)}", file=sys.stderr)
            return None
    torch.ops.load_library(str(library))
    return torch.ops.diffdraft_blocks


def _why(error: OSError | subprocess.CalledProcessError) -> str:
    """What stopped the build and what to do, in one line: a compiler's own first error line (its last
    line is often a caret under the source, which says nothing)."""
    if isinstance(error, OSError):
        return f"{error}; keeping dense weights. Install a C++ compiler (g++ 12 or newer) for the faster path"
    lines = [line.strip() for line in (error.stderr or "").splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")
    return (
        f"the compiler failed ({first}); keeping dense weights. An older g++ than 12 fails so: install "
        "g++ 12 or newer (or point $CXX at one) for the faster path, or report that line if yours is"
    )


def library_key() -> str:
    """Identifies the kernel library: its sources, torch version and compiler flags (what a cached
    measurement of its speed depends on, as the compiled library does)."""
    sources = [path.read_bytes() for path in _sources()]
    digest = hashlib.sha1(b"\0".join([*sources, torch.__version__.encode(), " ".join(flags()).encode()]))
    return digest.hexdigest()[:16]


def _library_path() -> Path:
    return cache_root() / "kernels" / f"q4_1_matmul-{library_key()}.so"


def _sources() -> tuple[Path, ...]:
    """Read at call time, so a test can swap one."""
    return SOURCE, INT8_SOURCE, DECODER_SOURCE, LOOP_SOURCE, ARGMAX_SOURCE, TOPK_SOURCE, INTRINSICS


def _compile(library: Path) -> None:
    """Compile into a temp dir beside the cache entry, then link into place with its digest
    (:func:`diffdraft.util.cache_digest.sealed_file`): a concurrent or killed build never leaves a
    library that is loaded half-written. The sources compile side by side, one compiler per core (the
    AVX2 build takes minutes on one)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler found (looked for $CXX, g++, c++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(library)
    try:
        includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
        libraries = [f"-L{path}" for path in torch.utils.cpp_extension.library_paths()]
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        cflags = flags()
        sources = [source for source in _sources() if source.suffix == ".cpp"]  # the header is included
        objects = [tmp / f"{source.stem}.o" for source in sources]
        steps = progress_bar(
            total=len(sources) + 1,
            desc=f"diffdraft: compiling the quantized CPU kernel for {instruction_set()} (once; "
            "1 to 4 minutes on 2 cores, longer while other work runs)",
            unit="step",
        )
        with steps, ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            compiled = [
                pool.submit(_run, [compiler, *cflags, abi, *includes, "-c", str(source), "-o", str(output)])
                for source, output in zip(sources, objects, strict=True)
            ]
            for job in as_completed(compiled):
                job.result()
                steps.update()
            linked = [*map(str, objects), *libraries, "-lc10", "-ltorch_cpu"]
            with sealed_file(library) as built:
                _run([compiler, *cflags, "-shared", *linked, "-o", str(built)])
            steps.update()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)
