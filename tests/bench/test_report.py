"""The written report: tables a person reads, divergences with token text, and real PNG files."""

from __future__ import annotations

import json

from diffdraft.bench.report import write_outputs
from diffdraft.bench.runner import BenchRun
from diffdraft.bench.summary import checks, summarize

from diffdraft_testing.bench import CURVE, record
from diffdraft_testing.checkpoints import tiny_tokenizer

HEADER = {
    "command": "diffdraft bench --quick",
    "target": "tiny",
    "dtype": "bfloat16",
    "drafter": None,
    "options": {"samples": 1},
    "started": "now",
    "elapsed_seconds": 1.0,
    "environment": {
        "cpu": "cpu", "cores": 2, "threads": 1, "device": "cpu", "torch": "t", "transformers": "x",
        "busy_before": 0.5, "busy_after": None, "load_average": "0",
    },
}  # fmt: skip


def test_the_report_shows_every_method_and_explains_divergences(tmp_path):
    records = [record("ar", 0, 1.0, [1] * 9), record("ddtree:8", 0, 0.5, [3, 1, 2, 3], sizes=8)]
    records += [
        record("ddtree:16", 0, 0.6, [3, 1, 2, 3], sizes=16),
        record("pld", 0, 0.9, [2, 1, 2, 1, 2, 1]),
    ]
    records[1].divergence = {
        "position": 4, "reference_token": 5, "method_token": 6, "top1": 5, "top2": 6,
        "margin": 0.01, "gap": 0.01, "explained": True,
    }  # fmt: skip
    records[2].divergence = dict(records[1].divergence, gap=3.0, explained=False)
    summaries = summarize(records, CURVE, "bfloat16")
    written = write_outputs(
        tmp_path, HEADER, BenchRun(records), summaries, checks(summaries), CURVE, tiny_tokenizer()
    )
    assert sorted(p.name for p in written) == [
        "acceptance_histograms.png", "budget_sweep.png", "report.md", "results.json", "stage_times.png",
    ]  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert "| ddtree:8 | 20.0 | 20.0 | 2.00x |" in report  # tok/s, decode tok/s (no prefill here), speedup
    assert "CPU busy with other work 50% before the run, n/a after" in report and "**Warning" in report
    assert "0/1 identical, 1 near-tie" in report and "**FAIL: 1 unexplained**" in report
    assert "| set | s | 0 | ddtree:8 | 1 | 4 |" in report and "| 0.010 | 0.010 | near-tie |" in report
    assert "**BUG: clear margin** |" in report
    assert "| 0 | 10.0 | 20.0 |" in report and "| 100 | 20.0 | 30.0 |" in report  # t(q, n) per context
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["records"]) == 4 and results["summaries"][1]["tau"] == 2.25
    for name in ("budget_sweep.png", "acceptance_histograms.png", "stage_times.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_the_report_splits_draft_latency_and_shows_ngram_lookups(tmp_path):
    records = [record("ar", 0, 1.0, [1] * 9), record("dart:8", 0, 0.5, [3, 1, 2, 3], sizes=8)]
    records[1].completion.stages["ngram"] = 0.004
    records[1].completion.ngram_lookups, records[1].completion.ngram_lookup_median = 400, 7e-6
    summaries = summarize(records, CURVE, "bfloat16")
    header = HEADER | {"dart_drafter": "default-dart", "ngram": "default"}
    write_outputs(tmp_path, header, BenchRun(records), summaries, checks(summaries), CURVE, tiny_tokenizer())
    report = (tmp_path / "report.md").read_text()
    assert "DART drafter: default-dart (N-gram trie: default)" in report
    assert "| draft | n-gram lookups | tree build |" in report
    assert "| dart:8 | 100.0 | 7.0 | 10.0 | 1.00 |" in report  # per round: 100 lookups, 1 ms
    assert "| ar | 100.0 |" not in report  # methods without lookups get no row
