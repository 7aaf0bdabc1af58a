"""Building the kernel: cached by source and torch version, and a missing compiler leaves dense weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffdraft.kernels.quantized import kernel_build

from diffdraft_testing.markers import needs_block_kernel


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """block_kernel() as in a new process whose cache is empty."""
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    kernel_build.block_kernel.cache_clear()
    yield tmp_path
    kernel_build.block_kernel.cache_clear()


@needs_block_kernel
def test_without_a_compiler_the_kernel_is_absent_and_says_why(fresh_build, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    assert kernel_build.block_kernel() is None
    err = capsys.readouterr().err
    assert "cannot build the quantized CPU kernel" in err and "Install a C++ compiler" in err
    assert not list((fresh_build / "kernels").glob("*.so"))  # nothing half-built left behind


@needs_block_kernel
def test_a_failed_compile_names_the_compiler_s_error_line(fresh_build, monkeypatch, capsys):
    """The compiler's last line is often a caret under the source: the message gives its error line."""
    compiler = fresh_build / "failing-compiler"
    compiler.write_text(
        "#!/bin/sh\necho 'x.cpp:3:1: error: an intrinsic is unknown' >&2\necho '  |  ^~~' >&2\nexit 1\n"
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    assert kernel_build.block_kernel() is None
    err = capsys.readouterr().err
    assert "the compiler failed (x.cpp:3:1: error: an intrinsic is unknown)" in err and "g++ 12" in err


def test_the_library_name_changes_with_the_source(fresh_build, monkeypatch, tmp_path):
    first = kernel_build._library_path()
    changed = tmp_path / "changed.cpp"
    changed.write_text(kernel_build.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(kernel_build, "SOURCE", changed)
    assert kernel_build._library_path() != first
    assert first.parent == fresh_build / "kernels"


def _cpu(monkeypatch, capability: str, bf16: bool = True, vnni: bool = True, avx_vnni: bool = True) -> None:
    """Make torch report a CPU of ``capability`` with or without AVX-512's bfloat16 and VNNI dot products,
    and Linux one with or without AVX-VNNI (and ask for no build: the checks of the narrower builds below
    run these tests with one asked for)."""
    monkeypatch.delenv(kernel_build.ISA_VARIABLE, raising=False)
    flags = frozenset({"avx2", "avx_vnni"} if avx_vnni else {"avx2"})
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


def test_each_cpu_gets_the_widest_build_it_runs_each_cached_apart(fresh_build, monkeypatch):
    libraries = set()
    for features, build in [
        ({"bf16": True, "vnni": True}, "avx512"),
        ({"bf16": False, "vnni": True}, "avx512-vnni"),
        ({"bf16": True, "vnni": False}, "avx2-vnni"),
        ({"bf16": True, "vnni": False, "avx_vnni": False}, "avx2"),
        ({"bf16": False, "vnni": False, "avx_vnni": False}, "avx2"),
    ]:
        _cpu(monkeypatch, "AVX512", **features)
        assert kernel_build.instruction_set() == build, features
        libraries.add(kernel_build._library_path())
    assert len(libraries) == 4
    _cpu(monkeypatch, "AVX2")
    assert kernel_build.instruction_set() == "avx2-vnni"
    _cpu(monkeypatch, "AVX2", avx_vnni=False)
    assert kernel_build.instruction_set() == "avx2"


def test_the_build_without_bf16_leaves_out_only_the_bf16_instructions(monkeypatch):
    _cpu(monkeypatch, "AVX512", bf16=False)
    assert set(kernel_build.ISA_FLAGS["avx512"]) - set(kernel_build.flags()) == {"-mavx512bf16"}
    _cpu(monkeypatch, "AVX512", vnni=False, avx_vnni=False)
    assert "-mavx2" in kernel_build.flags() and not any("avx512" in flag for flag in kernel_build.flags())
    _cpu(monkeypatch, "AVX2")
    avx2 = kernel_build.COMMON_FLAGS + kernel_build.ISA_FLAGS["avx2"]
    assert set(kernel_build.flags()) ^ set(avx2) == {"-mavxvnni"}


def test_a_narrower_build_can_be_asked_for_a_wider_one_or_another_name_cannot(monkeypatch):
    _cpu(monkeypatch, "AVX512")
    for build in ("avx512-vnni", "avx2-vnni", "avx2"):
        monkeypatch.setenv(kernel_build.ISA_VARIABLE, build)
        assert kernel_build.instruction_set() == build
    monkeypatch.setenv(kernel_build.ISA_VARIABLE, "avx512f")
    with pytest.raises(ValueError, match="may only be one of avx512, avx512-vnni, avx2-vnni, avx2"):
        kernel_build.instruction_set()
    _cpu(monkeypatch, "AVX512", bf16=False, avx_vnni=False)
    monkeypatch.setenv(kernel_build.ISA_VARIABLE, "avx512")
    with pytest.raises(ValueError, match="this CPU lacks; it runs avx512-vnni, avx2:"):
        kernel_build.instruction_set()
    _cpu(monkeypatch, "AVX2", avx_vnni=False)
    monkeypatch.setenv(kernel_build.ISA_VARIABLE, "avx2-vnni")
    with pytest.raises(ValueError, match="this CPU lacks; it runs avx2:"):
        kernel_build.instruction_set()


_BUILDS = kernel_build._available_builds()
NARROWER_BUILDS = _BUILDS[1:] if _BUILDS and kernel_build.instruction_set() == _BUILDS[0] else []
"""The builds this CPU runs besides its widest, each what some other CPU runs natively; none when these
tests already run on one of them (the run on the widest checks them all, once each)."""


@pytest.fixture(scope="module")
def narrower_runs(request, tmp_path_factory):
    """The kernel tests of each narrower build this session checks, each in a process that builds and
    loads it, all started at once: {build: (process, its output file)}. A build's tests run on one
    thread (tests/conftest.py); side by side, the other build's compile or tests take the core they
    leave idle, where one after the other they left it idle for each build's tests."""
    checked = {
        item.callspec.params["build"]
        for item in request.session.items
        if item.originalname == "test_the_kernel_tests_pass_on_each_narrower_build_too"
    }
    folder = Path(__file__).parent
    runs = {}
    for build in sorted(checked & set(NARROWER_BUILDS)):
        output = tmp_path_factory.mktemp(f"kernel-tests-{build}") / "output.txt"
        with output.open("w") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(folder)],
                env={**os.environ, kernel_build.ISA_VARIABLE: build},
                cwd=folder.parents[2],
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        runs[build] = process, output
    yield runs
    for process, _ in runs.values():
        if process.poll() is None:  # its test did not wait for it (stopped first)
            process.kill()
            process.wait()


@pytest.mark.parametrize("build", ["avx512-vnni", "avx2-vnni", "avx2"])
def test_the_kernel_tests_pass_on_each_narrower_build_too(build, narrower_runs):
    """A CPU runs its widest build everywhere else, so each narrower one that other CPUs run is checked
    here: the kernel tests again, in a process that builds and loads it (:func:`narrower_runs`)."""
    if build not in NARROWER_BUILDS:
        pytest.skip(f"{build} is not a narrower build checked from this run (see NARROWER_BUILDS)")
    process, output = narrower_runs[build]
    returncode = process.wait()
    assert returncode == 0, output.read_text()[-6000:]


def test_a_cpu_without_avx2_keeps_dense_weights(fresh_build, monkeypatch):
    _cpu(monkeypatch, "DEFAULT", bf16=False, vnni=False)
    assert not kernel_build.cpu_supported()
    assert kernel_build.block_kernel() is None


@pytest.fixture
def stand_in_build(fresh_build, monkeypatch):
    """block_kernel() in a fresh process whose "compilation" links a one-function library (in a
    second, not the kernel's minutes) and whose loads are recorded with whether the file was intact
    then; yields (builds, loads)."""
    from diffdraft.util.cache_digest import problem, sealed_file

    source = fresh_build / "stand_in.c"
    source.write_text("int stand_in(void) { return 83; }\n")
    builds, loads = [], []
    real_load = torch.ops.load_library

    def compile_stand_in(library):
        builds.append(library)
        with sealed_file(library) as built:
            subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(built)], check=True)

    def load_library(path):
        loads.append((path, problem(Path(path))))
        real_load(path)

    monkeypatch.setattr(kernel_build, "_compile", compile_stand_in)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    return builds, loads


@needs_block_kernel
@pytest.mark.parametrize("damage", ["truncated", "killed before its manifest"])
def test_a_damaged_library_is_never_loaded_but_built_again(stand_in_build, capsys, damage):
    """Issue 83's third row: loading a truncated library died of a bus error, with no message. A library
    whose size or digest differs from its manifest's, or that has none, is named and built again; only
    an intact library is ever loaded."""
    builds, loads = stand_in_build
    assert kernel_build.block_kernel() is not None
    library = kernel_build._library_path()
    size = library.stat().st_size
    if damage == "truncated":
        # a new file in its place: truncating the loaded one in place would take the pages this process
        # has mapped from it, and the process would die of a bus error when it exits
        cut = library.with_name(f"{library.name}.cut")
        cut.write_bytes(library.read_bytes()[: size // 2])
        os.replace(cut, library)
        found = f"{library.name} is {size // 2} bytes, {size} when written"
    else:
        library.with_name(f"{library.name}.manifest").unlink()
        found = "no manifest"
    kernel_build.block_kernel.cache_clear()
    capsys.readouterr()
    assert kernel_build.block_kernel() is not None
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"diffdraft: the cached quantized CPU kernel at {library} failed its check ({found}"
    )
    assert line.endswith("; compiling it again")
    assert builds == [library, library]
    assert [(Path(path), problem) for path, problem in loads] == [(library, None), (library, None)]


@needs_block_kernel
def test_an_intact_library_is_loaded_without_building_it(stand_in_build, capsys):
    builds, loads = stand_in_build
    kernel_build.block_kernel()
    kernel_build.block_kernel.cache_clear()
    capsys.readouterr()
    kernel_build.block_kernel()
    assert len(builds) == 1 and len(loads) == 2
    assert capsys.readouterr().err == ""
