"""The synthetic round benchmark at CI size: its outputs checked for shape and sense, never for speed."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diffdraft.bench import synthetic
from diffdraft.bench.synthetic import OFFICIAL, ROUND_STAGES, SHAPES, Settings
from diffdraft.bench.synthetic_report import write_outputs

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "synthetic_round_bench.py"
try:  # the official package is optional: without it the runs go on, minus its loop
    import dflash.model  # noqa: F401

    HAS_DFLASH = True
except ImportError:
    HAS_DFLASH = False
ROUNDS, WARMUP = 3, 1


def load_script():
    spec = importlib.util.spec_from_file_location("synthetic_round_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict]:
    """One tiny run of the script, in float64 so that every loop's greedy tokens must agree exactly."""
    out = tmp_path_factory.mktemp("synthetic")
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float64", "--budgets", "8,64"]
    argv += ["--rounds", str(ROUNDS), "--warmup", str(WARMUP), "--profile", "--out", str(out)]
    load_script().main(argv)
    return out, json.loads((out / "results.json").read_text())


def test_writes_every_output(smoke):
    out, results = smoke
    assert (out / "round_stages.png").read_bytes().startswith(b"\x89PNG")
    report = (out / "report.md").read_text()
    for method in results["methods"]:
        assert f"| {method['method']} | {method['loop']} |" in report
    table = report[report.index("| method |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(results["methods"])
    assert len({row.count("|") for row in table}) == 1  # header, separator and rows line up
    profile = (out / "profile.md").read_text()
    assert "## chain" in profile and "## ddtree:64" in profile
    assert results["profiles"]["chain"]["per_round"]["aten::mm"]["count"] > 0


def test_records_what_it_ran_on(smoke):
    _, results = smoke
    env = results["environment"]
    assert env["device"] == "cpu" and env["dtype"] == "float64" and env["torch"] == torch.__version__
    assert "--shape tiny" in env["command"]
    assert results["shapes"]["target"]["hidden_size"] == SHAPES["tiny"].target["hidden_size"]
    assert results["shapes"]["drafter"]["block_size"] == 16
    assert results["settings"]["context"] == SHAPES["tiny"].context


def test_methods_verify_the_tokens_their_trees_hold(smoke):
    _, results = smoke
    methods = {m["method"]: m for m in results["methods"]}
    expected = ["ar", "chain", "ddtree:8", "ddtree:64"] + ([OFFICIAL] if HAS_DFLASH else [])
    assert list(methods) == expected
    verified = {"ar": 1, "chain": 16, "ddtree:8": 9, "ddtree:64": 65, OFFICIAL: 16}
    for name, method in methods.items():
        assert method["verified_tokens"] == verified[name]
        assert 1 <= method["tau"] <= method["verified_tokens"]
        assert method["rounds"] == ROUNDS == len(results["raw"][name]["round_ms"])
        assert 0 < method["round_ms_min"] <= method["round_ms_median"]


def test_stage_times_add_up_to_the_round(smoke):
    _, results = smoke
    for method in results["methods"]:
        if method["method"] == OFFICIAL:
            assert method["stage_ms"] == {}  # the official loop is timed whole
            continue
        stages = method["stage_ms"]
        drafts = method["method"] != "ar"  # plain decoding pays no draft stage
        assert all(stages[stage] > 0 for stage in ROUND_STAGES if drafts or stage != "draft")
        assert (stages["draft"] > 0) == drafts
        total = sum(stages[stage] for stage in ROUND_STAGES)
        assert 0.5 * method["round_ms_mean"] < total <= method["round_ms_mean"] * 1.001
        assert stages["other"] == pytest.approx(method["round_ms_mean"] - total)


def test_every_loop_generates_plain_decodings_tokens(smoke):
    _, results = smoke
    tokens = results["tokens"]
    assert len(set(tokens["ar"])) > 1  # a random target that repeats one token would prove nothing
    for method in results["methods"]:
        assert method["tokens_compared"] >= WARMUP + ROUNDS + 1
        assert method["tokens_matching_ar"] == method["tokens_compared"]


def test_ratios_use_plain_decoding_and_the_official_loop(smoke):
    _, results = smoke
    methods = {m["method"]: m for m in results["methods"]}
    assert methods["ar"]["break_even_tau"] == pytest.approx(1.0)
    # a ratio of two timed rounds (its size is the benchmark's to report: on a tiny model under a loaded
    # machine a chain round has timed below a plain one, failing a full CI run)
    assert 0 < methods["chain"]["break_even_tau"] < float("inf")
    for method in methods.values():
        assert (method["official_over_this"] is not None) == HAS_DFLASH
    if HAS_DFLASH:
        official = methods[OFFICIAL]
        assert official["official_over_this"] == pytest.approx(1.0)
        assert methods["chain"]["official_over_this"] == pytest.approx(
            official["round_ms_mean"] / methods["chain"]["round_ms_mean"]
        )


def test_a_failing_official_loop_leaves_our_numbers(monkeypatch):
    def fail(*args, **kwargs):
        raise AttributeError("'DynamicCache' object has no attribute 'activate_past_recording'")

    monkeypatch.setattr(synthetic, "time_official", fail)
    settings = Settings(shape="tiny", device="cpu", dtype="float32", budgets=(8,), rounds=1, warmup=0)
    results = synthetic.run_benchmark(settings, "test", log=lambda line: None)
    assert [m["method"] for m in results["methods"]] == ["ar", "chain", "ddtree:8"]
    if HAS_DFLASH:
        assert "activate_past_recording" in results["official_error"]


def test_full_acceptance_commits_whole_blocks_in_both_loops():
    """The other fixed point: the official loop's tokens per round are read from its forwards' positions,
    so rounds that commit many tokens check that bookkeeping."""
    settings = Settings(shape="tiny", device="cpu", dtype="float32", budgets=(8,), rounds=2, warmup=1)
    results = synthetic.run_benchmark(replace(settings, acceptance="full"), "test", log=lambda line: None)
    methods = {m["method"]: m for m in results["methods"]}
    assert methods["ar"]["tau"] == 1
    for name in ["chain", OFFICIAL] if HAS_DFLASH else ["chain"]:
        assert methods[name]["tau"] == 16 == methods[name]["verified_tokens"]
        assert methods[name]["tokens_compared"] == len(results["tokens"]["ar"]) == 1 + 3
        assert methods[name]["tokens_matching_ar"] == 4
    if HAS_DFLASH:
        assert results["tokens"][OFFICIAL] == results["tokens"]["chain"]  # 1 + 3 rounds x 16 tokens
        assert len(results["tokens"]["chain"]) == 1 + 3 * 16


def test_qwen3_8b_shapes_are_the_real_ones():
    """Built on the meta device: the shapes without a byte of weights."""
    shape = SHAPES["qwen3-8b"]
    target = synthetic.build_target(shape, torch.device("meta"), torch.bfloat16, seed=0)
    drafter = synthetic.build_drafter(shape, target, seed=0)
    assert synthetic.parameter_count(target) == 8_190_735_360  # Qwen3-8B's count
    assert target.dtype == drafter.fc.weight.dtype == torch.bfloat16
    assert len(drafter.layers) == 5 and drafter.block_size == 16 and drafter.mask_token_id == 151669
    assert drafter.fc.weight.shape == (4096, 5 * 4096)
    assert drafter.layers[0].mlp.up_proj.weight.shape == (12288, 4096)
    if HAS_DFLASH:  # the official model loads our layout at the real shape, strictly
        official = synthetic.official_drafter(drafter)
        assert official.target_layer_ids == [1, 9, 17, 25, 33] and official.block_size == 16


def test_attention_backends_restrict_every_loop_and_are_recorded(tmp_path):
    """The lease's check of whether cuDNN's per-shape attention plans slow the drafter: a run restricted
    to a backend the device lacks fails (the restriction reaches the attention calls), one restricted to
    ``math`` runs, and the report says which ran."""
    settings = Settings(shape="tiny", device="cpu", dtype="float32", budgets=(8,), rounds=1, warmup=0)

    def quiet(line: str) -> None:
        pass

    with pytest.raises(RuntimeError, match="kernel"):  # efficient attention is CUDA-only
        synthetic.run_benchmark(replace(settings, sdpa_backends=("efficient_attention",)), "test", quiet)
    results = synthetic.run_benchmark(replace(settings, sdpa_backends=("math",)), "test", quiet)
    assert results["settings"]["sdpa_backends"] == ["math"]
    write_outputs(results, tmp_path)
    assert "| attention | SDPA backends math only |" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match=r"unknown attention backend.*'flash_attention'"):
        synthetic.attention_backends(["flash"])
