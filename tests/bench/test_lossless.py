"""The losslessness check: identical outputs pass, near-ties are explained, clear margins are bugs."""

from __future__ import annotations

import pytest

from diffdraft.bench.lossless import LosslessChecker, first_divergence

from diffdraft_testing.bench import FixedLogits


def test_first_divergence_counts_a_length_difference():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_a_near_tie_is_explained_and_a_clear_margin_is_not():
    model = FixedLogits([0.0, 9.0, 10.0, 9.9, 2.0])
    checker = LosslessChecker(lambda: model, tolerance=0.5)
    assert checker.check([7, 8], [2, 2, 1], [2, 2, 1]) is None
    tie = checker.check([7, 8], [2, 2, 2], [2, 2, 3])
    assert model.seen[-1] == [7, 8, 2, 2]  # the float32 recomputation sees the shared prefix
    assert (tie.position, tie.reference_token, tie.method_token) == (2, 2, 3)
    assert (tie.top1, tie.top2) == (2, 3)
    assert tie.margin == pytest.approx(0.1, abs=1e-5) and tie.gap == pytest.approx(0.1, abs=1e-5)
    assert tie.explained
    bug = checker.check([7, 8], [2, 2, 2], [2, 2, 4])
    assert bug.gap == pytest.approx(8.0) and not bug.explained


def test_in_float32_any_divergence_is_a_bug_and_an_early_stop_is_never_explained():
    model = FixedLogits([0.0, 10.0, 9.999])
    assert not LosslessChecker(lambda: model, tolerance=0.0).check([1], [1, 2], [2, 2]).explained
    stopped = LosslessChecker(lambda: model, tolerance=10.0).check([1], [1, 2], [1])
    assert stopped.method_token is None and not stopped.explained
