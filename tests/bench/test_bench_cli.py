"""``diffdraft bench`` end to end on tiny saved models: all three outputs, and a planted mismatch fails."""

from __future__ import annotations

import argparse
import json

import pytest

from diffdraft.bench import methods
from diffdraft.bench.cli import _deer_drafter, add_bench_parser, run_bench
from diffdraft.bench.journal import JOURNAL
from diffdraft.bench.methods import MethodSpec, OursRunner, register
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.errors import InvalidRequestError
from diffdraft.target.loading import load_target

from diffdraft_testing.checkpoints import make_checkpoint, save_dart_and_trie, save_deer
from diffdraft_testing.drafters import tiny_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = make_checkpoint(root / "target", "llama")
    save_draft_model(tiny_drafter(load_target(target).model, block_size=4).float(), root / "drafter")
    save_dart_and_trie(target, root)
    save_deer(target, root / "deer")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world, the quick"}\n{"prompt": "the quick brown fox"}\n')
    return root, target, prompts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def bench(argv: list[str]) -> int:
    return run_bench(parse(argv))


def common(setup, out) -> list[str]:
    root, target, prompts = setup
    return [
        "--target", str(target), "--datasets", str(prompts), "--max-new-tokens", "10", "--repeats", "2",
        "--warmup-tokens", "2", "--cost-cache", str(root / "cost"), "--out", str(out), "--no-progress",
    ]  # fmt: skip


def test_the_bench_writes_results_report_and_plots(setup, tmp_path, capsys):
    root, *_ = setup
    out = tmp_path / "out"
    code = bench([*common(setup, out), "--drafter", str(root / "drafter"), "--budgets", "2,4,auto"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == [
        "ar",
        "hf",
        "hf-pld:3",
        "hf-pld:10",
        "pld",
        "chain",
        "ddtree:2",
        "ddtree:4",
        "ddtree:auto",
        "chain+pld",
        "ddtree+pld:32",
        "dart-tree:59",  # DART's tree over --drafter (no trie for this target: without its N-gram term)
    ]
    assert len(results["records"]) == 2 * 2 * 12
    assert all(r["compared"] == (r["method"] != "ar") and r["divergence"] is None for r in results["records"])
    assert results["cost_curve"]["sizes"][0] == 1
    report = (out / "report.md").read_text()
    assert "diffdraft bench --target" in report and "| ddtree:auto |" in report and "## Checks" in report
    assert "## ddtree:auto: the cost model's view" in report
    view = results["auto_budget"]["ddtree:auto"]  # the plan's budget is the best it shows (0: plain)
    expected = {int(b): rate for b, rate in view["expected_tokens_per_second"].items()}
    assert expected[view["budget"]] == max(expected.values())
    for plot in ("budget_sweep.png", "acceptance_histograms.png", "stage_times.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert "skipping hf-assisted" in err and "skipping dart:59" in err and "skipping ddtree-dart:59" in err
    assert "skipping deer: " in err and "skipping deer-tree:32" in err and "--deer-drafter" in err
    assert results["deer_drafter"] is None
    assert not (out / JOURNAL).exists()  # only an unfinished run leaves its journal


def test_dart_runs_beside_dflash_with_its_ngram_lookups_timed(setup, tmp_path):
    root, *_ = setup
    out = tmp_path / "out"
    dart = ["--dart-drafter", str(root / "dart"), "--ngram", str(root / "trie")]
    methods = ["--methods", "ddtree:4,dart:8,dart-no-ngram:8,ddtree-dart:4,dart-tree:8"]
    code = bench([*common(setup, out), "--drafter", str(root / "drafter"), *dart, *methods])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["ar", *methods[1].split(",")]
    assert results["dart_drafter"] == str(root / "dart") and results["ngram"] == str(root / "trie")
    assert "--dart-drafter" in results["command"] and "--ngram" in results["command"]
    assert all(r["divergence"] is None for r in results["records"])
    for r in results["records"]:
        with_trie = r["method"] in ("dart:8", "dart-tree:8")
        assert (r["stages"]["ngram"] > 0) == with_trie == (r["ngram_lookups"] > 0)
    report = (out / "report.md").read_text()
    assert "| method | lookups per round | median us per lookup |" in report
    assert "| dart:8 |" in report and "n-gram lookups" in report


def test_deer_runs_beside_dflash_with_its_tau_and_draft_latency_reported(setup, tmp_path):
    root, *_ = setup
    out = tmp_path / "out"
    deer = ["--deer-drafter", str(root / "deer"), "--methods", "ddtree:4,deer,deer-tree:4"]
    assert bench([*common(setup, out), "--drafter", str(root / "drafter"), *deer]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["ar", "ddtree:4", "deer", "deer-tree:4"]
    assert results["deer_drafter"] == str(root / "deer") and "--deer-drafter" in results["command"]
    assert all(r["divergence"] is None for r in results["records"])
    deer_records = [r for r in results["records"] if r["method"].startswith("deer")]
    assert deer_records and all(r["stages"]["draft"] > 0 for r in deer_records)
    report = (out / "report.md").read_text()
    for method in ("deer", "deer-tree:4"):  # the summary, time-per-round and acceptance tables
        assert sum(line.startswith(f"| {method} |") for line in report.splitlines()) >= 3


def test_the_default_target_defaults_to_the_shipped_deer_drafter():
    assert _deer_drafter(parse([])) == "default-deer"
    assert _deer_drafter(parse(["--target", "elsewhere"])) is None
    assert _deer_drafter(parse(["--deer-drafter", "mine"])) == "mine"


class OffByOne:
    """Plain AR with its third token replaced: the kind of bug the lossless check exists for."""

    def __init__(self, models, spec):
        self.inner = OursRunner(models, MethodSpec("ar"), needs_drafter=False)
        self.spec, self.dtype = spec, self.inner.dtype

    def generate(self, request):
        done = self.inner.generate(request)
        if len(done.token_ids) > 2:
            done.token_ids[2] = (done.token_ids[2] + 1) % 320
        return done


def test_a_planted_mismatch_fails_the_run_loudly(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))
    register("broken", OffByOne)
    out = tmp_path / "out"
    assert bench([*common(setup, out), "--methods", "broken"]) == 1
    assert "LOSSLESS CHECK FAILED" in capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert "**BUG: clear margin**" in report and "**FAIL: 4 unexplained**" in report


def test_batch_sizes_measure_whole_batch_throughput_losslessly(setup, tmp_path):
    root, *_ = setup
    out = tmp_path / "batch"
    argv = [*common(setup, out), "--drafter", str(root / "drafter"), "--batch-sizes", "1,2"]
    assert bench(argv) == 0
    data = json.loads((out / "batch.json").read_text())
    points = {(p["method"], p["batch_size"]): p for p in data["points"]}
    assert set(points) == {(m, b) for m in ("ar", "ddtree:8", "ddtree+pld:8") for b in (1, 2)}
    for point in points.values():
        assert point["violations"] == 0
        assert point["identical"] == 2  # float32: every output equals plain AR's at batch 1
        assert len(point["seconds"]) == 2 and point["tokens"] > 0
    assert points["ar", 1]["tokens"] == points["ddtree+pld:8", 2]["tokens"]
    assert set(data["verify_cost"]["seconds"]) == {"1", "2"}
    assert "--batch-sizes 1,2" in data["command"]
    assert "| ddtree+pld:8 |" in (out / "batch.md").read_text()
    assert (out / "batch_throughput.png").stat().st_size > 0


def test_batch_sizes_refuse_methods_without_a_batch_mode(setup, tmp_path):
    with pytest.raises(InvalidRequestError, match="drop hf"):
        bench([*common(setup, tmp_path / "x"), "--methods", "ar,hf", "--batch-sizes", "1,2"])
    with pytest.raises(InvalidRequestError, match="at least 1"):
        bench([*common(setup, tmp_path / "x"), "--batch-sizes", "0"])


def test_a_sliding_window_target_is_benched_losslessly(setup, tmp_path):
    """Gemma 3 with windows of 3 keys: shorter than every prompt plus its generation."""
    *_, prompts = setup
    target = make_checkpoint(tmp_path / "gemma3", "gemma3")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "sliding_window": 3}))
    model = load_target(target).model
    assert model.config.sliding_window == 3
    save_draft_model(tiny_drafter(model, block_size=4).float(), tmp_path / "drafter")
    argv = ["--target", str(target), "--datasets", str(prompts), "--max-new-tokens", "10", "--repeats", "1"]
    argv += ["--warmup-tokens", "2", "--out", str(tmp_path / "out"), "--no-progress"]
    argv += ["--drafter", str(tmp_path / "drafter"), "--methods", "pld,chain,ddtree:4,ddtree+pld:8"]
    assert bench(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["methods"] == ["ar", "pld", "chain", "ddtree:4", "ddtree+pld:8"]
    assert all(r["divergence"] is None for r in results["records"])
