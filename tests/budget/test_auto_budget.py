"""The auto budget's builder: trees of the planned size, surrogates and exploration on refresh trees, and
the lone plan's view it reports."""

from __future__ import annotations

import math

import pytest
import torch

from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner, rounds_of
from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees import DDTreeBuilder, RoundSequence, TreeRound

from diffdraft_testing.budget import verified


def test_the_auto_builder_keeps_the_best_first_prefix_of_the_planned_size_and_explores_past_it():
    # t(q) flat up to 9 tokens then steep: the plan should settle on 8 nodes
    curve = VerifyCostCurve(sizes=[1, 9, 10, 64], contexts=[512], seconds=[[0.01, 0.01, 0.05, 1.0]])
    builder = AutoBudgetBuilder(BudgetPlanner(curve), initial_budget=2, refresh=2)
    log_probs = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).mul(2).log_softmax(-1)
    proposal = Proposal(log_probs=log_probs)
    stats = GenerationStats()
    # a new sequence drafts whatever it costs: nothing is known of what it will accept
    assert builder.plan([RoundSequence(stats, 300, can_draft=True)]) == [1]
    tree = builder.build(TreeRound(5, proposal, SamplingParams(), None, context=300, stats=stats, budget=8))
    # the refresh tree verifies half the planned budget more, to measure the ranks past it
    expected = DDTreeBuilder(12).build(TreeRound(5, proposal, SamplingParams(), None))
    assert stats.budgets == [8] and len(stats.surrogates) == 1  # recorded in the sequence's own stats
    assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)
    verified(stats, tree.num_nodes, [1], context=300, seconds=0.02)
    assert builder.plan([RoundSequence(stats, 302, can_draft=True)]) == [8]  # the last flat size
    assert builder.plan([RoundSequence(stats, 302, can_draft=False)]) == [0]
    tree = builder.build(TreeRound(5, proposal, SamplingParams(), None, context=302, stats=stats, budget=8))
    assert tree.num_nodes == 8
    verified(stats, tree.num_nodes, [], context=302, seconds=0.01)
    # the next refresh verifies a quarter of the budget less, to measure what a node costs around it
    tree = builder.build(TreeRound(5, proposal, SamplingParams(), None, context=304, stats=stats, budget=8))
    assert tree.num_nodes == 6
    verified(stats, tree.num_nodes, [2], context=304, seconds=0.01)
    assert builder.planner.rank_gains()[1].sum() == 0  # nothing learned while the sequence runs
    builder.observe_generation(stats)
    assert stats.budgets == [8, 8, 8]
    assert builder.planner.surrogate() == pytest.approx(builder.planner.surrogate(stats))
    assert [r.context for r in rounds_of(stats)] == [300, 302, 304]
    observed, counts = builder.planner.rank_gains()
    assert counts[5] == 3 and counts[7] == 2 and counts[8] == 1
    assert observed[0] == 1 and observed[1] == 1 and observed[2:].sum() == 0
    # another sequence's first refresh tree looks ahead from its own plan's budget, not from this one's
    other = GenerationStats()
    tree = builder.build(TreeRound(5, proposal, SamplingParams(), None, context=10, stats=other, budget=3))
    assert tree.num_nodes == 5
    assert other.budgets == [3]


def test_a_first_tree_looks_ahead_from_the_initial_budget_until_a_finished_sequence_taught_the_planner():
    curve = VerifyCostCurve(sizes=[1, 256], contexts=[512], seconds=[[0.01, 0.02]])
    builder = AutoBudgetBuilder(BudgetPlanner(curve), initial_budget=32, refresh=4, lookahead=4)
    # nothing known yet: the first surrogate reaches far past the plan, so the next plan can grow
    assert builder.deepest(5, GenerationStats()) == 4 * 32
    builder.planner.observe_proposal([1.0, 1.6, 1.9])
    # once taught, the plan's budget stands in for the last one a sequence does not have yet
    assert builder.deepest(5, GenerationStats()) == 4 * 5
    assert builder.deepest(None, GenerationStats()) == 4 * 32  # no plan: the initial budget


def test_without_a_plan_a_tree_keeps_the_last_budget():
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.02]])
    builder = AutoBudgetBuilder(BudgetPlanner(curve), initial_budget=6, refresh=4)
    proposal = Proposal(
        log_probs=torch.randn(4, 30, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    )
    stats = GenerationStats()
    builder.build(TreeRound(5, proposal, SamplingParams(), None, context=10, stats=stats, budget=4))
    tree = builder.build(TreeRound(5, proposal, SamplingParams(), None, context=11, stats=stats))
    assert tree.num_nodes == 4
    assert stats.budgets == [4, 4]


def test_the_drafter_is_asked_for_as_deep_as_the_rounds_tree_reaches():
    curve = VerifyCostCurve(sizes=[1, 9, 10, 64], contexts=[512], seconds=[[0.01, 0.01, 0.05, 1.0]])
    builder = AutoBudgetBuilder(BudgetPlanner(curve), initial_budget=3, refresh=2, lookahead=4)
    log_probs = torch.randn(20, 50, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    stats = GenerationStats()
    reached = []
    for _ in range(4):
        deepest = builder.deepest(5, stats)
        tree = builder.build(
            TreeRound(
                5, Proposal(log_probs=log_probs[:deepest]), SamplingParams(), None, stats=stats, budget=5
            )
        )
        reached.append((deepest, int(tree.depths.max())))
    # refresh rounds (every second tree) read the surrogate of a tree 4 x the budget; the others
    # draft to the budget; no tree reaches past what was asked for
    assert [deepest for deepest, _ in reached] == [20, 5, 20, 5]
    assert all(depth <= deepest for deepest, depth in reached)
    assert (
        builder.deepest(None, GenerationStats()) == 4 * 4
    )  # a first tree refreshes: initial budget 3, at least 4


def saturating_tau(max_budget: int, scale: float = 16.0) -> list[float]:
    return [1.0 + 3.0 * (1.0 - math.exp(-b / scale)) for b in range(max_budget + 1)]


def promising(curve: VerifyCostCurve, draft: float = 0.0, commit: float = 0.0) -> AutoBudgetBuilder:
    """An auto budget whose finished sequences promised :func:`saturating_tau` and drafted in ``draft``
    seconds a round alone, each round committing in ``commit``."""
    builder = AutoBudgetBuilder(BudgetPlanner(curve))
    builder.planner.observe_proposal(saturating_tau(255))
    builder.rounds._draft_seconds.add(True, draft)
    builder.rounds._commit_seconds.add(True, commit)
    return builder


def test_the_report_shows_the_lone_plan_a_flat_then_steep_curve_filled_to_its_last_flat_budget():
    # verifying up to 33 tokens costs the same; 34 costs double: with acceptance still growing, B = 32 wins
    curve = VerifyCostCurve(sizes=[1, 33, 34, 256], contexts=[512], seconds=[[0.01, 0.01, 0.02, 1.0]])
    view = promising(curve).describe(512)
    assert view["budget"] == 32
    assert view["expected_tokens_per_second"][32] == pytest.approx(saturating_tau(255)[32] / 0.01)


def test_the_reported_budget_is_the_brute_force_optimum_costed_as_the_round_planner_costs_it():
    """A drafting round pays the drafter's time and every round its commit, plain decoding (budget 0)
    included: the report's view is the lone plan's, not one per-round cost for every budget."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    curve = VerifyCostCurve(sizes=sizes, contexts=[512], seconds=[[0.02 * (1 + q / 48) for q in sizes]])
    tau = saturating_tau(255)

    def rate(b: int, draft: float, commit: float) -> float:
        return tau[b] / (curve(b + 1, 512) + draft * (b > 0) + commit)

    for draft, commit in ((0.0, 0.0), (0.002, 0.001), (0.2, 0.001)):
        view = promising(curve, draft, commit).describe(512)
        best = max(range(256), key=lambda b: rate(b, draft, commit))
        assert view["budget"] == best
        assert view["expected_tokens_per_second"][best] == pytest.approx(rate(best, draft, commit))
        assert view["expected_tokens_per_second"][0] == pytest.approx(1.0 / (curve(1, 512) + commit))
    # a slow drafter makes each drafting round worth filling; one slower still, not worth drafting
    assert promising(curve, 0.02).describe(512)["budget"] > promising(curve).describe(512)["budget"]
    assert promising(curve, 10.0).describe(512)["budget"] == 0


def test_the_reported_budget_shrinks_where_long_contexts_make_big_trees_expensive():
    # at 128 cached tokens 64 nodes cost what one does; at 1024 every node costs more
    short, long = [0.01, 0.01, 0.04], [0.01, 0.03, 0.1]
    curve = VerifyCostCurve(sizes=[1, 65, 256], contexts=[128, 1024], seconds=[short, long])
    builder = promising(curve)
    assert builder.describe(128)["budget"] == 64
    assert 0 < builder.describe(1024)["budget"] < 64
