"""The batch cost curve: interpolation over (tokens, sequences, context), measurement, fit and cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffdraft.budget import batch_cost
from diffdraft.budget.batch_cost import BatchCostCurve, load_or_measure_batch_cost, measure_batch_cost
from diffdraft.target.model import TargetModel

from diffdraft_testing.budget import slow_after_bigger_forwards
from diffdraft_testing.targets import tiny_target


def test_the_curve_shares_tokens_evenly_and_interpolates_every_axis():
    # [batch][context][size]: 2 or 4 sequences of 1 or 9 tokens each, over 100 or 300 cached tokens
    curve = BatchCostCurve(
        batches=[2, 4],
        sizes=[1, 9],
        contexts=[100, 300],
        seconds=[[[1.0, 3.0], [2.0, 4.0]], [[2.0, 6.0], [4.0, 8.0]]],
    )
    assert curve(2, 2, 100) == pytest.approx(1.0)  # 2 sequences of 1 token
    assert curve(10, 2, 100) == pytest.approx(2.0)  # of 5 tokens: halfway to 9
    assert curve(4, 4, 200) == pytest.approx(3.0)  # 4 of 1 token, between the contexts
    assert curve(6, 3, 100) == pytest.approx((1.25 + 2.5) / 2)  # 3 sequences of 2 tokens: between batches
    assert curve(8, 8, 100) == pytest.approx(4.0)  # past the largest batch: linear
    totals = np.array([2, 10, 18])
    assert curve(totals, 2, 100) == pytest.approx([1.0, 2.0, 3.0])
    assert curve(50, 2, 50) == pytest.approx(7.0)  # flat below the smallest context, linear past 9 tokens
    # several forwards at once, one shape each: as one by one
    shapes = [(2, 2, 100), (10, 2, 100), (4, 4, 200), (6, 3, 100), (8, 8, 100), (50, 2, 50), (7, 3, 400)]
    tokens, batch, context = np.array(shapes, dtype=float).T
    assert curve(tokens, batch, context) == pytest.approx([curve(*shape) for shape in shapes])


def test_measuring_is_monotone_in_every_axis_and_the_cache_is_reused(tmp_path, monkeypatch):
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_batch_cost(target, batches=(2, 3), sizes=(1, 4, 64), contexts=(8, 512), repeats=1)
    assert curve.sizes == [1, 4]  # sizes past half the context are dropped
    assert curve.contexts == [8, 60]  # contexts past the model's window are cut to fit
    seconds = np.asarray(curve.seconds)
    assert seconds.shape == (2, 2, 2) and seconds.min() > 0
    for axis in range(3):
        assert (np.diff(seconds, axis=axis) >= 0).all()

    monkeypatch.setattr(batch_cost, "BATCHES", (2,))
    monkeypatch.setattr(batch_cost, "SIZES", (1, 2))
    monkeypatch.setattr(batch_cost, "CONTEXTS", (8,))
    first = load_or_measure_batch_cost(target, cache_dir=tmp_path)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".manifest"]  # the curve, its digest
    assert load_or_measure_batch_cost(target, cache_dir=tmp_path) == first
    monkeypatch.setattr(batch_cost, "SIZES", (1, 2, 3))  # a newer grid: the cached curve is measured anew
    assert load_or_measure_batch_cost(target, cache_dir=tmp_path).sizes == [1, 2, 3]


def test_one_token_a_sequence_is_timed_deep_in_a_run_as_plain_decoding_runs_it(monkeypatch):
    """On a machine whose one-token forward runs slow right after a bigger one, the curve's plain
    points are the run's."""
    monkeypatch.setattr(batch_cost, "_time_batch", slow_after_bigger_forwards())
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_batch_cost(target, batches=(2,), sizes=(1, 4), contexts=(8,), repeats=2)
    assert curve.measured == [[[pytest.approx(0.001), pytest.approx(0.01)]]]
