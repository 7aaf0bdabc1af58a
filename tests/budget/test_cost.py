"""The verification cost curve: interpolation, the monotone fit, measurement and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from diffdraft.budget import cost
from diffdraft.budget.cost import VerifyCostCurve, load_or_measure, measure_verify_cost
from diffdraft.target.model import TargetModel

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


def test_measuring_gives_every_size_and_the_cache_is_reused_until_it_stops_matching(tmp_path, monkeypatch):
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 4, 16, 64), contexts=(8, 40, 512), repeats=1)
    assert curve.sizes == [1, 4, 16]  # sizes past half the context are dropped
    assert curve.contexts == [8, 40, 48]  # contexts past the model's window are cut to fit
    assert len(curve.seconds) == 3 and all(len(row) == 3 and min(row) > 0 for row in curve.seconds)
    assert curve.seconds == cost.monotone_fit(curve.measured)

    monkeypatch.setattr(cost, "DEFAULT_SIZES", (1, 4, 8))
    monkeypatch.setattr(cost, "DEFAULT_CONTEXTS", (16, 32))
    first = load_or_measure(target, cache_dir=tmp_path)
    [file] = tmp_path.glob("*.json")
    monkeypatch.setattr(cost, "still_valid", lambda curve, target: True)
    assert load_or_measure(target, cache_dir=tmp_path) == first

    monkeypatch.undo()
    stale = json.loads(file.read_text())
    stale["seconds"] = [[100 * t for t in row] for row in stale["seconds"]]  # a much slower machine
    file.write_text(json.dumps(stale))
    assert not cost.still_valid(VerifyCostCurve(**stale), target)
    assert load_or_measure(target, cache_dir=tmp_path).seconds != stale["seconds"]


def test_a_cached_curve_survives_a_cold_first_probe_but_not_one_that_stays_off(monkeypatch):
    """One probe wanders (a fresh process's first most): one off by more than the tolerance keeps the
    curve when the next one agrees; a curve every probe disagrees with is measured anew."""
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    curve = measure_verify_cost(target, sizes=(1, 4), contexts=(8,), repeats=1)
    slowdowns = []

    def probe(target, sizes, contexts, repeats):
        factor = slowdowns.pop(0)
        return VerifyCostCurve(
            sizes=list(sizes),
            contexts=list(contexts),
            seconds=[[factor * curve(q, contexts[0]) for q in sizes]],
        )

    monkeypatch.setattr(cost, "measure_verify_cost", probe)
    slowdowns[:] = [1.5, 1.1]
    assert cost.still_valid(curve, target) and not slowdowns
    slowdowns[:] = [1.5, 1.5, 1.0]
    assert not cost.still_valid(curve, target) and slowdowns == [1.0]  # stale after two probes


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


def test_a_damaged_cached_curve_is_named_and_measured_again(tmp_path, monkeypatch, capsys):
    """A curve whose bytes changed on disk is not planned with: one line says so, and it is measured
    again; an intact one is reused without a word."""
    target = TargetModel(tiny_target(dtype=torch.float32, max_positions=64))
    measured = []

    def measure(target, sizes, contexts, progress=False):
        measured.append(sizes)
        return VerifyCostCurve(sizes=[1, 4], contexts=[8], seconds=[[0.001, 0.002]])

    monkeypatch.setattr(cost, "measure_verify_cost", measure)
    monkeypatch.setattr(cost, "still_valid", lambda curve, target: True)
    first = load_or_measure(target, cache_dir=tmp_path)
    assert load_or_measure(target, cache_dir=tmp_path) == first and len(measured) == 1
    [file] = tmp_path.glob("*.json")
    file.write_text(file.read_text().replace("0.002", "0.200"))  # the same size, another curve
    capsys.readouterr()
    assert load_or_measure(target, cache_dir=tmp_path).seconds == first.seconds
    assert len(measured) == 2
    assert capsys.readouterr().err == (
        f"diffdraft: the cached verification cost curve at {file} failed its check "
        f"({file.name} digest mismatch); measuring it again\n"
    )
