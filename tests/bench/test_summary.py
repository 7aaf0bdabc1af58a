"""Summaries from raw records: speedups per repeat, acceptance statistics, bounds and pass/fail checks."""

from __future__ import annotations

import pytest

from diffdraft.bench.summary import checks, summarize

from diffdraft_testing.bench import CURVE, record


def test_speedup_is_per_repeat_with_spread_and_acceptance_is_counted():
    records = [
        record("ar", 0, 1.0, [1] * 9),
        record("ar", 1, 2.0, [1] * 9),
        record("ddtree:8", 0, 0.5, [3, 1, 2, 3], sizes=8),
        record("ddtree:8", 1, 0.5, [3, 1, 2, 3], sizes=8),
        record("hf", 0, 1.0, [1] * 9, engine="transformers"),
        record("hf", 1, 1.0, [1] * 9, engine="transformers"),
        record("llama.cpp", 0, 0.4, [1] * 9, engine="llama.cpp"),
    ]
    by_method = {s.method: s for s in summarize(records, CURVE, "float32")}
    tree = by_method["ddtree:8"]
    assert tree.tokens_per_second.mean == pytest.approx(20.0)  # 10 tokens in 0.5 s
    assert (tree.speedup.low, tree.speedup.high) == pytest.approx((2.0, 4.0))
    assert tree.speedup_vs_hf == pytest.approx(2.0)
    assert tree.tau == pytest.approx(2.25) and tree.histogram == {1: 2, 2: 2, 3: 4}
    # position 1 accepted in 6 of 8 rounds; position 2 in 4 of the 6 that got there; position 3
    # (drafted, depth 7) reached by the 4 length-3 rounds and never accepted
    assert tree.position_acceptance == pytest.approx([0.75, 4 / 6, 0.0])
    # bound = tau t(1) / t(q) with q = 8 verified tokens and no drafter time, both taken at the
    # contexts the rounds verified over: the 5 prompt tokens plus what earlier rounds committed
    contexts = [5, 8, 9, 11]
    t_one = sum(CURVE(1, n) for n in contexts) / 4
    t_eight = sum(CURVE(8, n) for n in contexts) / 4
    assert tree.bound == pytest.approx(2.25 * t_one / t_eight)
    assert by_method["ar"].bound == pytest.approx(1.0)
    # our cost curve bounds our engine only: another engine's rows get none
    assert by_method["hf"].bound is None and by_method["llama.cpp"].bound is None
    assert tree.compared == tree.identical == 2


def test_checks_compare_auto_with_the_sweep_and_ddtree_with_the_baselines():
    records = [
        record("ar", 0, 1.0, [1] * 8),
        record("hf", 0, 1.0, [1] * 8),
        record("hf-pld:3", 0, 0.5, [2] * 4),
    ]
    records += [record("ddtree:8", 0, 0.25, [3, 3, 2]), record("ddtree:auto", 0, 0.26, [3, 3, 2])]
    found = {c.name: c for c in checks(summarize(records, CURVE, "float32"))}
    assert found["ddtree:auto / best swept"].passed
    assert found["ddtree:8 / best hf"].value == pytest.approx(4.0) and found["ddtree:8 / best hf"].passed
    assert found["ddtree:8 / best hf-pld"].value == pytest.approx(2.0)
    assert found["lossless vs plain AR"].passed
    records[-1] = record("ddtree:auto", 0, 0.4, [3, 3, 2])
    found = {c.name: c for c in checks(summarize(records, CURVE, "float32"))}
    assert not found["ddtree:auto / best swept"].passed


def test_the_speed_checks_take_the_fastest_ddtree_with_or_without_the_lookup_boost():
    records = [record("ar", 0, 1.0, [1] * 8), record("hf", 0, 1.0, [1] * 8)]
    records += [record("ddtree:8", 0, 0.5, [3, 3, 2]), record("ddtree+pld:8", 0, 0.25, [4, 4])]
    records += [record("ddtree+pld:auto", 0, 0.5, [4, 4])]
    found = {c.name: c for c in checks(summarize(records, CURVE, "float32"))}
    assert found["ddtree+pld:8 / best hf"].value == pytest.approx(4.0)
    assert "ddtree:8 / best hf" not in found
    # each family's auto budget is held against its own sweep
    assert found["ddtree+pld:auto / best swept"].value == pytest.approx(0.5)
    assert "ddtree:auto / best swept" not in found


def test_every_tree_family_run_with_an_auto_budget_is_held_against_its_own_sweep():
    records = [record("ar", 0, 1.0, [1] * 8), record("deer-tree:8", 0, 0.5, [3, 3, 2])]
    records += [record("deer-tree:auto", 0, 1.0, [3, 3, 2]), record("ddtree:auto", 0, 0.5, [3, 3, 2])]
    found = {c.name: c for c in checks(summarize(records, CURVE, "float32"))}
    assert found["deer-tree:auto / best swept"].value == pytest.approx(0.5)
    assert "ddtree:auto / best swept" not in found  # nothing swept to hold it against


def test_the_decode_rate_leaves_the_prefills_out():
    records = [record("ar", r, 1.0, [1] * 9, prefill=0.5) for r in range(2)]  # 10 tokens a second each
    [summary] = summarize(records, CURVE, "bfloat16")
    assert summary.tokens_per_second.mean == pytest.approx(10.0)
    assert summary.decode_tokens_per_second == pytest.approx(20.0)


def test_positions_a_round_did_not_draft_do_not_count_against_it():
    # a prompt-lookup round that drafted 1 token and had it accepted must not lower position 2
    records = [record("ar", 0, 1.0, [1] * 4), record("pld", 0, 1.0, [2, 2, 3], sizes=2)]
    records[1].completion.draft_depths = [1, 1, 2]
    pld = {s.method: s for s in summarize(records, CURVE, "float32")}["pld"]
    assert pld.position_acceptance == pytest.approx([1.0, 1.0])


def test_ngram_lookups_are_counted_per_round_and_their_median_weighted_by_lookups():
    records = [record("ar", 0, 1.0, [1] * 4), record("dart:8", 0, 0.5, [3, 3, 2], sizes=8)]
    records += [record("dart:8", 1, 0.5, [3, 3, 2], sizes=8)]
    records[1].completion.ngram_lookups, records[1].completion.ngram_lookup_median = 30, 5e-6
    records[2].completion.ngram_lookups, records[2].completion.ngram_lookup_median = 10, 1e-6
    for r in records[1:]:
        r.completion.stages["ngram"] = 1e-4
    by_method = {s.method: s for s in summarize(records, CURVE, "float32")}
    dart = by_method["dart:8"]
    assert dart.ngram_lookups_per_round == pytest.approx(40 / 6)
    assert dart.ngram_lookup_us == pytest.approx(5.0)  # 30 of the 40 lookups had the 5 us median
    assert dart.stage_ms["ngram"] == pytest.approx(1e3 * 2e-4 / 6)
    assert by_method["ar"].ngram_lookup_us is None and by_method["ar"].stage_ms["ngram"] == 0.0
