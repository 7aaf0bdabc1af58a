"""The verification cost curve: interpolation, the monotone fit, measurement and its cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffdraft.budget import cost
from diffdraft.budget.cost import VerifyCostCurve, load_or_measure, measure_verify_cost
from diffdraft.target.model import TargetModel
from diffdraft.util.cache_digest import sealed_file

from diffdraft_testing.budget import slow_after_bigger_forwards
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target
from diffdraft_testing.targets import tiny_target


def test_the_curve_interpolates_and_extrapolates_linearly_in_size_and_context():
    curve = VerifyCostCurve(sizes=[1, 3, 5], contexts=[100, 200], seconds=[[1.0, 2.0, 4.0], [2.0, 3.0, 5.0]])
    assert curve(2, 100) == pytest.approx(1.5)
    assert curve(7, 100) == pytest.approx(6.0)
    assert curve(2, 150) == pytest.approx(2.0)
    assert curve(1, 400) == pytest.approx(4.0)  # attention keeps growing with the cache
    assert curve(1, 10) == pytest.approx(1.0)  # flat below the shortest measured context


def test_the_fit_pools_noisy_points_and_is_monotone_in_size_and_context():
    # rows: [3, 5, 4] -> [3, 4.5, 4.5] and [2, 1, 6] -> [1.5, 1.5, 6]; then columns pool the same way
    assert cost.monotone_fit([[3.0, 5.0, 4.0], [2.0, 1.0, 6.0]]) == [[2.25, 3.0, 4.5], [2.25, 3.0, 6.0]]
    measured = [[42.3, 47.0, 38.4, 44.2], [35.0, 34.9, 34.7, 38.3], [52.5, 46.7, 43.9, 49.8]]
    fitted = cost.monotone_fit(measured)
    for row in fitted:
        assert row == sorted(row)
    for column in zip(*fitted, strict=True):
        assert list(column) == sorted(column)
    assert cost.monotone_fit(fitted) == fitted  # a monotone table is its own fit
    assert cost.monotone_fit([[1.0, 2.0], [3.0, 4.0]]) == [[1.0, 2.0], [3.0, 4.0]]


def test_measuring_gives_every_size_and_a_cached_curve_is_used_as_it_is(tmp_path, monkeypatch):
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 4, 16, 64), contexts=(8, 40, 512), repeats=1)
    assert curve.sizes == [1, 4, 16]  # sizes past half the context are dropped
    assert curve.contexts == [8, 40, 48]  # contexts past the model's window are cut to fit
    assert len(curve.seconds) == 3 and all(len(row) == 3 and min(row) > 0 for row in curve.seconds)
    assert curve.seconds == cost.monotone_fit(curve.measured)

    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    first = load_or_measure(target, cache_dir=tmp_path)
    [file] = tmp_path.glob("*.json")
    assert load_or_measure(target, cache_dir=tmp_path) == first
    # a curve from a much slower machine (or day) is not probed again: the rounds rescale it
    slow = json.loads(file.read_text())
    slow["seconds"] = [[100 * t for t in row] for row in slow["seconds"]]
    with sealed_file(file) as written:
        written.write_text(json.dumps(slow))
    assert load_or_measure(target, cache_dir=tmp_path).seconds == slow["seconds"]
    assert load_or_measure(target, cache_dir=tmp_path, refresh=True).seconds != slow["seconds"]


def test_the_probe_stops_at_the_first_size_no_round_can_pay_for(monkeypatch):
    """Sizes past the first whose forward costs ``dearest`` plain ones are not timed: on a big model
    they would cost the probe seconds each."""
    timed = []

    def time_one(target, cache, tokens):
        timed.append(tokens.shape[0])
        return 0.001 * tokens.shape[0]  # a forward grows with every token

    monkeypatch.setattr(cost, "_time_one", time_one)
    monkeypatch.setattr(cost, "timed_in_a_run", lambda time_round: 0.001)
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 2, 4, 8, 16), contexts=(8, 16), repeats=1, dearest=3)
    assert curve.sizes == [1, 2, 4]  # 4 tokens cost 4 plain forwards: the last size timed
    assert sorted(set(timed)) == [2, 4]
    assert measure_verify_cost(target, sizes=(1, 2, 4, 8, 16), contexts=(8,), repeats=1).sizes[-1] == 16


def test_one_token_rounds_are_timed_deep_in_a_run_as_plain_decoding_runs_them(monkeypatch):
    """On a machine whose one-token forward runs slow right after a bigger one, t(1) is the run's,
    the bigger sizes' as measured."""
    monkeypatch.setattr(cost, "_time_one", slow_after_bigger_forwards())
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 4), contexts=(8,), repeats=2)
    assert curve.measured == [[pytest.approx(0.001), pytest.approx(0.01)]]


@needs_block_kernel
def test_a_block_targets_cached_curve_is_not_reused_once_the_kernel_source_changed(tmp_path, monkeypatch):
    from diffdraft.kernels.quantized import kernel_build

    block, dense = q4_1_target()
    before = cost.curve_key(TargetModel(block))
    plain = cost.curve_key(TargetModel(dense))
    changed = tmp_path / "changed.cpp"
    changed.write_text(kernel_build.INT8_SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(kernel_build, "INT8_SOURCE", changed)
    assert cost.curve_key(TargetModel(block)) != before
    assert cost.curve_key(TargetModel(dense)) == plain  # no kernel runs in a dense target


def test_a_damaged_cached_curve_is_named_and_probed_again(tmp_path, monkeypatch, capsys):
    """A curve whose bytes changed on disk is not planned with: one line says so, and it is probed
    again; an intact one is reused without a word."""
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    probed = []

    def probe(target, progress=False):
        probed.append(progress)
        return VerifyCostCurve(sizes=[1, 4], contexts=[8], seconds=[[0.001, 0.002]])

    monkeypatch.setattr(cost, "probe_verify_cost", probe)
    first = load_or_measure(target, cache_dir=tmp_path)
    assert load_or_measure(target, cache_dir=tmp_path) == first and len(probed) == 1
    [file] = tmp_path.glob("*.json")
    file.write_text(file.read_text().replace("0.002", "0.200"))  # the same size, another curve
    capsys.readouterr()
    assert load_or_measure(target, cache_dir=tmp_path).seconds == first.seconds
    assert len(probed) == 2
    assert capsys.readouterr().err == (
        f"diffdraft: the cached verification cost curve at {file} failed its check "
        f"({file.name} digest mismatch); probing it again\n"
    )


def test_passes_past_the_first_timed_one_stop_once_the_measurement_took_its_time():
    """A loaded machine's probe gets the warm-up and one timed pass, a quiet one's every pass."""
    steady = lambda: np.array([[1.0, 2.0]])  # noqa: E731
    assert list(cost.timed_passes(3, None, steady)) == [0, 1, 2, 3]
    assert list(cost.timed_passes(3, 60.0, steady)) == [0, 1, 2, 3]
    assert list(cost.timed_passes(3, 0.0, steady)) == [0, 1]


def test_a_disturbed_table_is_timed_again_up_to_a_limit():
    """A point far dearer than one with more work was timed while something else ran: passes go on
    past the limit until the fastest times agree, or until MAX_PASSES."""
    assert cost.disturbed(np.array([[1.0, 2.0], [1.6, 1.0]]))  # more context, less time
    assert cost.disturbed(np.array([[4.0, 2.0]]))  # a bigger tree, half the time
    assert not cost.disturbed(np.array([[1.0, 1.4], [1.2, 1.3]]))  # within the noise
    settles = iter([np.array([[4.0, 2.0]]), np.array([[1.0, 2.0]])])
    assert list(cost.timed_passes(1, 0.0, lambda: next(settles))) == [0, 1, 2]
    never = lambda: np.array([[4.0, 2.0]])  # noqa: E731
    assert list(cost.timed_passes(1, 0.0, never)) == list(range(cost.MAX_PASSES + 1))


def test_each_point_keeps_its_fastest_time(monkeypatch):
    """Other work only adds time: a probe keeps each point's fastest, so one slow pass of a big tree
    (the machine busy) leaves no mark."""
    slow = iter([0.002, 0.050, 0.002, 0.002])  # warm-up, then the 4-token point's timed passes

    def time_one(target, cache, tokens):
        return next(slow)

    monkeypatch.setattr(cost, "_time_one", time_one)
    monkeypatch.setattr(cost, "timed_in_a_run", lambda time_round: 0.001)
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 4), contexts=(8,), repeats=3)
    assert curve.measured == [[0.001, 0.002]]
