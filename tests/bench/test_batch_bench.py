"""The batch bench (bench/batching.py) report: ratios to plain AR, over medians and repeat by repeat."""

from __future__ import annotations

import pytest

from diffdraft.bench.batching import BatchPoint, BatchVerifyCost, batch_markdown, paired_ratios


def test_repeats_pair_with_the_plain_repeat_they_ran_beside():
    ar = BatchPoint("ar", 2, seconds=[1.0, 2.0, 1.0], tokens=100)
    ours = BatchPoint("ddtree:auto", 2, seconds=[0.5, 2.5, 1.25], tokens=100)
    assert paired_ratios(ours, ar) == pytest.approx([2.0, 0.8, 0.8])
    header = {"command": "c", "machine": "m", "started": "s", "elapsed_seconds": 1.0, "prompts": 2}
    header |= {"max_new_tokens": 8, "repeats": 3}
    report = batch_markdown(header, [ar, ours], BatchVerifyCost(16, {2: {1: 0.01}}))
    # the ratio of medians (1.0 s / 1.25 s) beside the median of the paired ratios and their range
    assert "80.0 (0.80x, tau 0.00)" in report
    assert "| ddtree:auto | 0.80x [0.80-2.00] |" in report


def test_tau_is_the_one_of_the_repeat_whose_throughput_is_reported():
    # an auto budget learns over the repeats: the first repeat's tau would sit beside the median's speed
    point = BatchPoint("ddtree:auto", 1, seconds=[3.0, 1.0, 2.0], tokens=10, taus=[1.5, 2.5, 2.0])
    assert point.tau == 2.0
    assert BatchPoint("ar", 1).tau == 0.0


def test_an_auto_budget_pairs_with_the_best_fixed_choice_at_each_batch_size():
    # ddtree+pld:6 leads at batch 1 and ar at batch 4 (by their median repeats): each is the reference there
    points = [
        BatchPoint("ar", 1, seconds=[2.0, 2.0, 2.0], tokens=100),
        BatchPoint("ddtree+pld:6", 1, seconds=[1.0, 1.5, 1.0], tokens=100),
        BatchPoint("ddtree+pld:auto", 1, seconds=[1.25, 1.5, 1.0], tokens=100),
        BatchPoint("ar", 4, seconds=[1.0, 1.0, 2.0], tokens=100),
        BatchPoint("ddtree+pld:6", 4, seconds=[2.0, 2.0, 2.0], tokens=100),
        BatchPoint("ddtree+pld:auto", 4, seconds=[1.0, 1.25, 2.0], tokens=100),
    ]
    header = {"command": "c", "machine": "m", "started": "s", "elapsed_seconds": 1.0, "prompts": 2}
    header |= {"max_new_tokens": 8, "repeats": 3}
    report = batch_markdown(header, points, BatchVerifyCost(16, {1: {1: 0.01}}))
    assert "| ddtree+pld:auto | 1.00x [0.80-1.00] (ddtree+pld:6) | 1.00x [0.80-1.00] (ar) |" in report
    # without a fixed budget beside ar there is no choice to compare with
    alone = batch_markdown(header, [points[0], points[2]], BatchVerifyCost(16, {1: {1: 0.01}}))
    assert "best fixed choice" not in alone
