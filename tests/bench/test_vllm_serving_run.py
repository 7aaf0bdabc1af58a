"""The pure parts of ``benchmarks/vllm-serving/run.py``: ``--drafter``, the runs each drafter gets,
the rows' variants and vLLM's quoted message."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm-serving" / "run.py"
spec = importlib.util.spec_from_file_location("vllm_serving_run", SCRIPT)
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)


def test_drafter_arg_takes_a_variant_and_a_path():
    assert run.drafter_arg("dspark=/tmp/x=y") == ("dspark", "/tmp/x=y")
    for bad in ("eagle=/tmp/x", "dflash2", "dflash="):
        with pytest.raises(argparse.ArgumentTypeError):
            run.drafter_arg(bad)


def test_each_drafter_gets_vllm_chain_and_ddtree_and_dflash_its_extra_rows():
    drafters = {"dflash": "default-dflash", "dspark": "runs/dspark"}
    assert run.vllm_engines(drafters) == ["plain", "dflash", run.K_NORM, "dspark"]
    labels = [row[0] for row in run.our_rows(drafters, 8)]
    assert labels == [
        "ar",
        "chain dflash",
        "chain-float32-rope dflash",
        "ddtree-8 dflash",
        "chain dspark",
        "ddtree-8 dspark",
    ]
    assert [row[0] for row in run.our_rows({"dflash2": "d"}, 0)] == ["ar", "chain dflash2"]
    assert run.step_pairs(["dflash2"]) == [("vLLM dflash2", "ours chain dflash2")]
    assert {run.variant_of(f"vLLM {e}") for e in run.vllm_engines(["dflash"])} == {None, "dflash"}
    assert run.variant_of("ours ddtree-8 dspark") == "dspark"


def test_vllm_says_quotes_the_exception_then_error_and_triton_lines():
    record = {
        "error": "ValidationError: 1 validation error for VllmConfig\n  Value error, no V1 support\n",
        "log_tail": "INFO loading\nWARNING Model Runner V2 requires Triton; using V1\nValueError: x\n",
    }
    assert run.vllm_says(record) == [
        "ValidationError: 1 validation error for VllmConfig",
        "  Value error, no V1 support",
        "WARNING Model Runner V2 requires Triton; using V1",
        "ValueError: x",
    ]
