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


def test_the_library_name_changes_with_the_source(fresh_build, monkeypatch, tmp_path):
    first = kernel_build._library_path()
    changed = tmp_path / "changed.cpp"
    changed.write_text(kernel_build.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(kernel_build, "SOURCE", changed)
    assert kernel_build._library_path() != first
    assert first.parent == fresh_build / "kernels"


def _cpu(monkeypatch, dot_products: bool, capability: str) -> None:
    """Make torch report a CPU with or without AVX-512's bfloat16 and VNNI dot products (and ask for no
    instruction set: the AVX2 check below runs these tests with one asked for)."""
    monkeypatch.delenv(kernel_build.ISA_VARIABLE, raising=False)
    for probe in ("_is_avx512_bf16_supported", "_is_vnni_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: dot_products, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


@pytest.mark.parametrize("missing", ["_is_avx512_bf16_supported", "_is_vnni_supported"])
def test_a_cpu_without_either_dot_product_builds_the_avx2_emulation(fresh_build, monkeypatch, missing):
    _cpu(monkeypatch, dot_products=True, capability="AVX512")
    assert kernel_build.instruction_set() == "avx512"
    avx512_library = kernel_build._library_path()
    monkeypatch.setattr(torch.cpu, missing, lambda: False, raising=False)
    assert kernel_build.instruction_set() == "avx2"
    assert "-mavx2" in kernel_build.flags() and not any("avx512" in flag for flag in kernel_build.flags())
    assert kernel_build._library_path() != avx512_library  # each build cached under its own name


def test_the_avx2_emulation_can_be_asked_for_and_nothing_else(monkeypatch):
    _cpu(monkeypatch, dot_products=True, capability="AVX512")
    monkeypatch.setenv(kernel_build.ISA_VARIABLE, "avx2")
    assert kernel_build.instruction_set() == "avx2"
    monkeypatch.setenv(kernel_build.ISA_VARIABLE, "avx512f")
    with pytest.raises(ValueError, match="may only be 'avx2'"):
        kernel_build.instruction_set()


@pytest.mark.skipif(
    kernel_build.instruction_set() != "avx512", reason="the AVX2 emulation is what this CPU runs anyway"
)
def test_the_kernel_tests_pass_on_the_avx2_emulation_too():
    """A CPU with AVX-512 runs the native build everywhere else, so the emulation that every AVX2 CPU
    runs is checked here: the kernel tests again, in a process that builds and loads it."""
    folder = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(folder)],
        env={**os.environ, kernel_build.ISA_VARIABLE: "avx2"},
        cwd=folder.parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_cpu_without_avx2_keeps_dense_weights(fresh_build, monkeypatch):
    _cpu(monkeypatch, dot_products=False, capability="DEFAULT")
    assert not kernel_build.cpu_supported()
    assert kernel_build.block_kernel() is None
