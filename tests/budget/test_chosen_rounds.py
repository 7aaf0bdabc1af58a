"""The chosen rounds' calibration: the share of the expected gain that rounds a plan chose to draft
realized, and plans that draft less once they learn their estimates were high."""

from __future__ import annotations

import pytest

from diffdraft.budget.chosen_rounds import MIN_ROUNDS, WINDOW, ChosenRounds
from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.budget.round_budget import RoundBudgetPlanner
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees import RoundSequence

from diffdraft_testing.budget import drafted_once, losing_planner

EXPECTED = [1.0, 2.0, 3.0, 4.0]
"""A plan's estimated acceptance length per budget 0..3."""


def chosen(accepted: list[int], size: int = 2) -> GenerationStats:
    """A finished sequence whose every round the plan chose to draft, its drafter's tree of ``size``
    nodes, that accepted ``accepted[i]`` tokens (bonus included) in round i."""
    stats = GenerationStats(tree_sizes=[size] * len(accepted), acceptance_lengths=list(accepted))
    stats.chosen_rounds = [(index, EXPECTED) for index in range(len(accepted))]
    return stats


def test_the_factor_is_the_realized_share_of_the_expected_gain_once_enough_rounds_came():
    calibration = ChosenRounds()
    calibration.observe(chosen([2] * (MIN_ROUNDS - 1)))  # expected gain 2 at 2 nodes, realized 1
    assert calibration.factor == 1.0  # too few rounds yet
    assert calibration.calibrated(EXPECTED) is EXPECTED
    calibration.observe(chosen([2]))
    assert calibration.factor == pytest.approx(0.5)
    assert calibration.calibrated(EXPECTED) == pytest.approx([1.0, 1.5, 2.0, 2.5])
    modest = chosen([3] * MIN_ROUNDS)
    modest.chosen_rounds = [(index, [1.0, 1.2, 1.4]) for index, _ in modest.chosen_rounds]
    more = ChosenRounds()
    more.observe(modest)  # more than expected: at most 1
    assert more.factor == 1.0


def test_a_factor_the_plans_stopped_drafting_on_ages_out_with_the_sequences_that_drafted_since():
    calibration = ChosenRounds()
    calibration.observe(chosen([1] * MIN_ROUNDS))  # none of the expected gain realized
    assert calibration.factor == 0.0
    explored = GenerationStats(tree_sizes=[3, 0, 0], acceptance_lengths=[2, 1, 1])  # no chosen round
    never_drafted = GenerationStats(tree_sizes=[0, 0], acceptance_lengths=[1, 1])
    for _ in range(WINDOW - 1):
        calibration.observe(explored)
        calibration.observe(never_drafted)  # teaches nothing, ages nothing
    assert calibration.factor == 0.0
    calibration.observe(explored)
    assert calibration.factor == 1.0  # the plans may choose to draft again, and learn anew


def test_a_round_is_expected_at_the_size_its_drafter_built_and_copies_teach_nothing():
    calibration = ChosenRounds()
    cut_short = chosen([2] * MIN_ROUNDS, size=1)  # a tree of 1 node, expected to gain 1: realized it
    cut_short.copy_rounds = [0]  # its first round verified a free copy: not the drafter's
    cut_short.acceptance_lengths[0] = 1
    calibration.observe(cut_short)
    assert calibration.factor == 1.0  # MIN_ROUNDS - 1 rounds counted
    calibration.observe(chosen([1]))
    assert calibration.factor == pytest.approx((MIN_ROUNDS - 1) / (MIN_ROUNDS + 1))


def test_only_rounds_the_plan_gave_a_tree_of_its_own_accord_are_recorded():
    rounds = losing_planner(explore_alone=2)
    explored = drafted_once(2)
    assert rounds.plan([RoundSequence(explored, 100, True)]) == [1]  # an exploration
    plain = drafted_once(1)
    assert rounds.plan([RoundSequence(plain, 100, True)]) == [0]
    assert explored.chosen_rounds == [] and plain.chosen_rounds == []


def test_a_plan_whose_chosen_rounds_realized_nothing_stops_drafting():
    # the forward costs 10 ms plus 1 ms per extra token, drafting 2 ms: the estimate makes drafting pay
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.073]])
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), explore_alone=1000)
    rounds._draft_seconds.add(True, 0.002)
    surrogates = [[1.0 + 0.3 * b for b in range(20)]]
    finished = GenerationStats(surrogates=surrogates)
    for _ in range(MIN_ROUNDS):
        budget = rounds.plan([RoundSequence(finished, 100, can_draft=True)])[0]
        assert budget > 0
        finished.tree_sizes.append(budget)
        finished.acceptance_lengths.append(1)  # the target accepted none of it
        finished.accepted_nodes.append([])
        finished.verify_forwards.append((1, budget + 1, 100))
        finished.verify_seconds.append(0.01)
    assert [index for index, _ in finished.chosen_rounds] == list(range(MIN_ROUNDS))
    assert finished.chosen_rounds[-1][1] is finished.tau_estimate.estimated  # before calibration
    fresh = GenerationStats(surrogates=surrogates)
    assert rounds.plan([RoundSequence(fresh, 100, can_draft=True)])[0] > 0
    rounds.observe_generation(finished)
    assert rounds.chosen[True].factor == 0.0  # a lone sequence's, which lone rounds read
    assert rounds.plan([RoundSequence(fresh, 100, can_draft=True)]) == [0]
