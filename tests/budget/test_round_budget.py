"""Round plans: budgets for a whole batch from stub costs where the optimum is known, free copies
that join while they pay, and rounds at budget 0 that change no output (plain decoding steps, or
a free copy verified like any tree)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch

from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner, rounds_of
from diffdraft.budget.round_budget import (
    TREE_SCALE_FLOOR,
    OwnRounds,
    RoundBudgetPlanner,
    plan_budgets,
    plan_copies,
)
from diffdraft.decoding.engine import PLAIN, RoundPlan, SpeculativeEngine
from diffdraft.drafters.base import Proposal
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, RoundSequence, TreeRound

from diffdraft_testing.batching import alone, batched, requests_for
from diffdraft_testing.budget import drafted_once, losing_planner, verified
from diffdraft_testing.drafters import tiny_dart
from diffdraft_testing.engine import make_method
from diffdraft_testing.targets import tiny_target


def concave_tau(largest: int, per_node: float) -> list[float]:
    return [1.0 + per_node * 8 * (1 - math.exp(-b / 8)) for b in range(largest + 1)]


def rate(budgets, taus, verify, draft_seconds, fixed_seconds) -> float:
    tokens = sum(budgets) + len(budgets)
    drafting = sum(b > 0 for b in budgets)
    return sum(t[b] for t, b in zip(taus, budgets, strict=True)) / (
        verify[tokens] + draft_seconds * drafting + fixed_seconds
    )


def test_speculation_that_loses_gets_budget_0_everywhere_and_that_wins_gets_budgets_above_0():
    taus = [concave_tau(16, 0.5)] * 8
    most = 8 * 17 + 1
    # a forward costs 10 ms a token and drafting 20 ms a sequence: every drafted node loses
    steep = 0.01 * np.arange(most)
    assert plan_budgets(taus, steep, 0.02, 0.001, [False] * 8) == [0] * 8
    # a flat forward (a GPU's) and cheap drafting: every sequence drafts the whole useful tree
    flat = np.full(most, 0.01)
    assert plan_budgets(taus, flat, 0.0001, 0.001, [False] * 8) == [16] * 8
    # sequences that cannot draft stay at 0; one that must explore drafts even where it loses
    assert plan_budgets([[1.0], *taus[:2]], steep, 0.02, 0.001, [False, True, False]) == [0, 1, 0]


def test_the_plan_is_near_the_brute_force_optimum_on_small_batches():
    """A local search: optimal on most draws, never far off (a swap of nodes between two sequences
    is no move it makes)."""
    g = np.random.default_rng(0)
    optimal = 0
    for _ in range(30):
        taus = [
            np.concatenate([[1.0], 1.0 + np.cumsum(np.sort(g.uniform(0, 0.8, 5))[::-1])]) for _ in range(3)
        ]
        verify = 0.01 + np.cumsum(g.uniform(0, 0.004, 19))
        draft, fixed = g.uniform(0, 0.01), g.uniform(0, 0.005)
        planned = plan_budgets(taus, verify, draft, fixed, [False] * 3)
        best = max(rate(b, taus, verify, draft, fixed) for b in itertools.product(range(6), repeat=3))
        assert rate(planned, taus, verify, draft, fixed) >= 0.95 * best
        optimal += rate(planned, taus, verify, draft, fixed) == pytest.approx(best)
    assert optimal >= 24


def test_a_sequence_alone_decodes_plainly_once_its_drafts_do_not_pay():
    # the forward costs 10 ms plus 10 ms per extra token, drafting 20 ms: no drafted node pays
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.64]])
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), explore_alone=4)
    rounds._draft_seconds.add(True, 0.02)
    stats = GenerationStats(surrogates=[[1.0 + 0.3 * b for b in range(20)]])
    assert rounds.plan([RoundSequence(stats, 100, can_draft=True)]) == [0]
    stats.tree_sizes = [3, 0, 0, 0, 0]  # nothing drafted for the last 4 rounds alone: it explores
    assert rounds.plan([RoundSequence(stats, 100, can_draft=True)]) == [1]
    cheap = RoundBudgetPlanner(
        BudgetPlanner(VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.01]]))
    )
    assert cheap.plan([RoundSequence(GenerationStats(surrogates=stats.surrogates), 100, True)]) == [19]


def test_a_batch_explores_about_once_per_explore_every_rounds_and_a_sequence_alone_more_often():
    rounds = losing_planner(explore_every=4, explore_alone=2)
    assert rounds.plan([RoundSequence(drafted_once(1), 100, True)]) == [0]
    assert rounds.plan([RoundSequence(drafted_once(2), 100, True)]) == [1]
    pair = [RoundSequence(drafted_once(4), 100, True), RoundSequence(drafted_once(7), 100, True)]
    assert rounds.plan(pair) == [0, 0]  # a pair waits 8 plain rounds each
    pair.append(RoundSequence(drafted_once(8), 100, True))
    assert rounds.plan(pair[1:]) == [0, 1]


@pytest.mark.parametrize("sequences", [1, 2])
def test_fruitless_explorations_come_ever_rarer_until_the_sequence_drafts_of_its_own_accord(sequences):
    rounds = losing_planner(explore_every=4, explore_alone=8)
    rounds.plain_rounds = 0  # every round planned anew: the explorations come exactly when due
    group = [drafted_once(0) for _ in range(sequences)]

    def explored_after(count: int) -> list[int]:
        """The rounds (of the first sequence) in which it drafted, over the next ``count`` rounds."""
        drafted = []
        for _ in range(count):
            budgets = rounds.plan([RoundSequence(stats, 100, True) for stats in group])
            for stats, budget in zip(group, budgets, strict=True):
                stats.tree_sizes.append(budget)
            if budgets[0]:
                drafted.append(len(group[0].tree_sizes) - 1)
        return drafted

    # due after 8 plain rounds (alone: explore_alone; a pair: explore_every x 2), then twice and four
    # times as long (explore_backoff 2), and no longer
    assert explored_after(80) == [9, 26, 59]
    assert group[0].fruitless_explorations == 3
    assert explored_after(40)[:1] == [92]
    group[0].surrogates = [[1.0 + 20.0 * b for b in range(20)]]  # now drafting pays: it drafts freely
    group[0].tau_estimate = None
    explored_after(1)
    assert group[0].fruitless_explorations == 0


def test_a_new_sequence_in_a_batch_drafts_its_first_round_only_while_the_planner_knows_no_proposal():
    rounds = losing_planner()
    pair = [RoundSequence(GenerationStats(), 100, True), RoundSequence(GenerationStats(), 100, True)]
    assert rounds.plan(pair) == [1, 1]
    rounds.planner.observe_proposal([1.0 + 0.3 * b for b in range(20)])
    assert rounds.plan(pair) == [0, 0]
    assert rounds.plan([RoundSequence(GenerationStats(), 100, True)]) == [1]  # alone, it always does


def test_a_round_like_the_last_reuses_its_plan(monkeypatch):
    from diffdraft.budget import round_budget

    planned = []
    monkeypatch.setattr(round_budget, "plan_budgets", lambda *args: planned.append(args) or [0])
    rounds = losing_planner()
    stats = drafted_once(1)
    for context in (100, 101, 120):
        assert rounds.plan([RoundSequence(stats, context, True)]) == [0]
        stats.tree_sizes.append(0)
    assert len(planned) == 1  # plain rounds changed nothing it plans from
    rounds.plan([RoundSequence(stats, 100 + rounds.context_step, True)])
    stats.tree_sizes.extend([2] * rounds.refresh)  # drafted rounds: a new acceptance estimate
    rounds.plan([RoundSequence(stats, 100 + rounds.context_step, True)])
    assert len(planned) == 3


def test_a_plan_that_left_a_batch_plain_stands_a_few_rounds_unless_it_copied_or_one_is_alone(monkeypatch):
    from diffdraft.budget import round_budget

    rounds = losing_planner()
    made = []
    inner = rounds._plan
    monkeypatch.setattr(rounds, "_plan", lambda sequences: made.append(1) or inner(sequences))
    pair = [RoundSequence(drafted_once(1), 100, True), RoundSequence(drafted_once(1), 100, True)]

    def round_of(sequences, copies):
        """What the engine asks each round: (budgets, copy lengths), None while a plain plan stands."""
        if rounds.plain_stands(len(sequences)):
            return None
        budgets = rounds.plan(sequences)
        return budgets, rounds.copy_lengths(budgets, copies)

    stood = [round_of(pair, [None, None]) for _ in range(rounds.plain_rounds + 2)]
    assert stood == [([0, 0], [0, 0])] + [None] * rounds.plain_rounds + [([0, 0], [0, 0])]
    assert len(made) == 2  # made, stood plain_rounds rounds, made again
    trio = [*pair, RoundSequence(drafted_once(1), 100, True)]
    assert round_of(trio, [None] * 3) is None  # a sequence joined: the plan stands all the same
    assert len(made) == 2
    for _ in range(3):
        assert round_of([pair[0]], [None])  # alone, a sequence is planned every round
    assert len(made) == 5
    monkeypatch.setattr(round_budget, "plan_copies", lambda *args: [1, 0])
    assert round_of(pair, [[1.0, 1.9], None]) == ([0, 0], [1, 0])
    assert round_of(pair, [None, None])  # the round copied: not plain, planned again
    assert len(made) == 7
    while rounds.plain_stands(2):
        pass
    budgets = rounds.plan(pair)
    assert rounds.copy_lengths(budgets, [[1.0, 1.9], None]) == [1, 0]  # a copy could pay...
    assert rounds.copy_lengths(budgets, [None, None]) == [0, 0]  # ...but none was offered
    assert rounds.plain_stands(2)  # the round's last answer took none: its plain plan stands


def test_a_plain_plan_made_plain_again_stands_ever_longer_and_settles_until_one_drafts(monkeypatch):
    from diffdraft.budget import round_budget

    rounds = losing_planner()
    pair = [RoundSequence(drafted_once(1), 100, True), RoundSequence(drafted_once(1), 100, True)]

    def stand() -> int:
        """Rounds the plan made now stands."""
        assert rounds.plan(pair) == [0, 0]
        stood = 0
        while rounds.plain_stands(2):
            stood += 1
        return stood

    most = rounds.plain_rounds << rounds.plain_backoff
    stands = []
    for _ in range(rounds.plain_backoff):
        assert not rounds.plain_settled()  # the stand has not backed off to its longest yet
        stands.append(stand())
    assert stands == [rounds.plain_rounds << k for k in range(rounds.plain_backoff)]
    with monkeypatch.context() as patched:  # rounds that copy in between
        patched.setattr(round_budget, "plan_copies", lambda *args: [1, 0])
        for _ in range(3):
            assert rounds.copy_lengths(rounds.plan(pair), [[1.0, 1.9], None]) == [1, 0]
            assert not rounds.plain_stands(2)  # planned again the next round
    assert [stand() for _ in range(2)] == [most, most]  # the copies left the stands as they were
    assert rounds.plain_settled()
    assert rounds.plan(pair[:1]) == [0]  # a round alone, plain
    assert stand() == most  # ...left them too
    assert rounds.plain_settled()
    monkeypatch.setattr(rounds, "_plan", lambda sequences: ([0, 1], [False, False]))
    rounds.plan(pair)  # a plan that drafts
    monkeypatch.undo()
    assert not rounds.plain_settled()
    assert stand() == rounds.plain_rounds


def test_a_sequence_left_alone_right_after_sharing_decodes_one_round_plainly():
    rounds = RoundBudgetPlanner(
        BudgetPlanner(VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.01]]))
    )
    stats = GenerationStats(surrogates=[[1.0 + 0.3 * b for b in range(20)]], tree_sizes=[0])
    stats.verify_forwards = [(2, 2, 100)]
    assert rounds.plan([RoundSequence(stats, 100, True)]) == [0]  # the others just ended
    stats.tree_sizes.append(0)
    stats.verify_forwards.append((1, 1, 101))
    assert rounds.plan([RoundSequence(stats, 101, True)]) == [19]  # still alone: drafting pays


def test_a_sequence_that_stopped_drafting_re_estimates_after_one_exploring_round():
    rounds = losing_planner()
    stats = drafted_once(3)
    stats.rounds, stats.accepted_nodes = 4, [[]] * 4
    stats.verify_contexts, stats.verify_seconds, stats.verify_forwards = (
        [100] * 4,
        [0.0] * 4,
        [(1, 1, 100)] * 4,
    )
    first = rounds.expected_tau(stats)
    assert rounds.expected_tau(stats) is first  # plain rounds taught it nothing
    stats.rounds += 1  # an exploring round whose first node was accepted
    stats.tree_sizes.append(2)
    stats.accepted_nodes.append([1])
    stats.verify_contexts.append(104)
    stats.verify_seconds.append(0.0)
    stats.verify_forwards.append((1, 3, 104))
    assert rounds.expected_tau(stats)[1] > first[1]


def shared_pair(tree_sizes: list[int]) -> GenerationStats:
    """A finished sequence whose rounds, of ``tree_sizes`` each, shared their forwards with another."""
    stats = GenerationStats(
        rounds=len(tree_sizes), tree_sizes=tree_sizes, accepted_nodes=[[]] * len(tree_sizes)
    )
    stats.verify_contexts, stats.verify_seconds = [100] * len(tree_sizes), [0.01] * len(tree_sizes)
    stats.verify_forwards = [(2, 2 + size, 100) for size in tree_sizes]
    return stats


def test_a_finished_sequence_re_estimates_the_running_ones_only_when_it_drafted():
    rounds = losing_planner()
    running = drafted_once(3)
    first = rounds.expected_tau(running)
    rounds.observe_generation(shared_pair([0, 0]))
    assert rounds.expected_tau(running) is first  # it taught nothing of acceptance
    rounds.observe_generation(shared_pair([3, 0]))
    assert rounds.expected_tau(running) is not first


def test_the_costs_are_read_anew_after_each_first_finished_sequence_then_after_every_few():
    rounds = losing_planner()
    taus = [[1.0, 1.5], [1.0, 1.5]]
    last, refreshed = rounds.round_costs(taus, 100), []
    for _ in range(3 * rounds.cost_refresh):
        rounds.observe_generation(shared_pair([0, 0]))
        costs = rounds.round_costs(taus, 100)
        refreshed.append(costs is not last)
        last = costs
    every = [False] * (rounds.cost_refresh - 1) + [True]
    assert refreshed == [True] * rounds.cost_refresh + every * 2


@pytest.mark.parametrize("seed", range(5))
def test_the_estimate_is_refreshed_when_the_rounds_since_it_say_so_counted_as_they_come(seed):
    """Counted round by round (the planner asks twice a round), the estimate goes stale exactly when
    the rounds since it, read whole, say: ``refresh`` drafted rounds, or one once a round around or
    since it drafted nothing (a plain round or a free copy)."""
    rounds = losing_planner()
    made = []
    rounds.planner.expected_tau = lambda stats: made.append([1.0]) or made[-1]
    rng = np.random.default_rng(seed)
    stats = GenerationStats()
    start = None
    for _ in range(120):
        if start is not None:
            drafted = sum(size > 0 for size in stats.drafter_sizes(start))
            skipped = 0 in stats.drafter_sizes(max(0, start - 1))
            stale = drafted >= (1 if skipped else rounds.refresh)
        before = len(made)
        for _ in range(int(rng.integers(1, 3))):
            rounds.expected_tau(stats)
        assert len(made) == before + (start is None or stale)
        if len(made) > before:
            start = len(stats.tree_sizes)
        kind = rng.choice(["drafted", "plain", "copy"], p=[0.7, 0.2, 0.1])
        if kind == "copy":
            stats.copy_rounds.append(len(stats.tree_sizes))
        stats.tree_sizes.append(0 if kind == "plain" else int(rng.integers(1, 9)))


def test_finished_sequences_teach_the_stage_costs_and_the_shared_forwards_scale():
    from diffdraft.budget.batch_cost import BatchCostCurve

    batch = BatchCostCurve(
        batches=[2, 4], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]], [[0.02, 0.04]]]
    )
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), batch)
    stats = GenerationStats(rounds=4, tree_sizes=[3, 0, 2, 0], accepted_nodes=[[], [], [], []])
    stats.verify_contexts, stats.verify_seconds = [100] * 4, [0.0399, 0.03995, 0.04005, 0.0401]
    stats.verify_forwards = [(2, 16, 100)] * 4  # twice what the batch curve says: the trees' part 3x
    stats.timings.update(draft=0.03, tree=0.012, mask=0.0, accept=0.004, commit=0.004)
    stats.draft_build_seconds = 0.01  # of the tree stage: the plain rounds' root-only trees took the rest
    rounds.observe_generation(stats)
    assert rounds.draft_seconds(alone=False) == pytest.approx(0.02)  # per drafting round
    assert rounds.commit_seconds(alone=False) == pytest.approx(0.002)
    assert rounds.batch_scale(2) == 1.0  # no plain forward timed: the curve's own, timed in a run
    assert rounds.verify_seconds(np.array([16]), 2, 100)[0] == pytest.approx(0.04)


def test_the_trees_extra_time_is_scaled_apart_from_the_plain_forwards():
    from diffdraft.budget.batch_cost import BatchCostCurve

    batch = BatchCostCurve(batches=[2], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]]])
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), batch)
    stats = GenerationStats(rounds=16, tree_sizes=[0] * 12 + [7] * 4, accepted_nodes=[[]] * 16)
    stats.verify_contexts = [100] * 16
    # plain 1.2x the curve (the first eight, after the prompt, untimed), a tree's extra 2x (times
    # apart: a forward counts once by shape and time)
    stats.verify_seconds = [0.03] * 8 + [0.0119, 0.01195, 0.01205, 0.0121, 0.0319, 0.03195, 0.03205, 0.0321]
    stats.verify_forwards = [(2, 2, 100)] * 12 + [(2, 16, 100)] * 4
    rounds.observe_generation(stats)
    assert rounds.batch_scale(2) == pytest.approx(1.2)
    assert rounds.tree_scale(2) == pytest.approx(2.0)
    assert rounds.verify_seconds(np.array([2, 9, 16]), 2, 100) == pytest.approx([0.012, 0.022, 0.032])


def test_trees_whose_forwards_read_no_dearer_than_plain_ones_are_not_taken_for_free():
    """Short copies add less to a forward than its plain part's noise: read as costing nothing, every
    node would pay and the plan would verify the biggest trees in every sequence."""
    from diffdraft.budget.batch_cost import BatchCostCurve

    batch = BatchCostCurve(batches=[2], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]]])
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), batch)
    stats = GenerationStats(rounds=16, tree_sizes=[0] * 12 + [1] * 4, accepted_nodes=[[]] * 16)
    stats.verify_contexts = [100] * 16
    stats.verify_seconds = [0.03] * 8 + [0.0119, 0.01195, 0.01205, 0.0121, 0.0110, 0.01105, 0.01095, 0.0111]
    stats.verify_forwards = [(2, 2, 100)] * 12 + [(2, 4, 100)] * 4  # copies of one token: faster than plain
    rounds.observe_generation(stats)
    assert rounds.batch_scale(2) == pytest.approx(1.2)
    assert rounds.tree_scale(2) == pytest.approx(TREE_SCALE_FLOOR * 1.2)


def test_the_trees_times_outlive_a_long_plain_stretch():
    from diffdraft.budget.batch_cost import BatchCostCurve

    batch = BatchCostCurve(batches=[2], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]]])
    rounds = RoundBudgetPlanner(
        BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), batch, timed_rounds=8
    )
    trees = [0.0319, 0.03195, 0.03205, 0.0321]  # past the plain part (scale 1): 2.2x the curve's extra
    plain = [0.01 * (1 + i / 100_000) for i in range(40)]  # then plain rounds only: five windows
    stats = GenerationStats(rounds=44, tree_sizes=[7] * 4 + [0] * 40, accepted_nodes=[[]] * 44)
    stats.verify_contexts, stats.verify_seconds = [100] * 44, trees + plain
    stats.verify_forwards = [(2, 16, 100)] * 4 + [(2, 2, 100)] * 40
    rounds.observe_generation(stats)
    assert rounds.tree_scale(2) == pytest.approx(2.2, rel=0.01)


def test_a_shared_forward_counts_once_and_the_latest_forwards_are_kept():
    from diffdraft.budget.batch_cost import BatchCostCurve

    batch = BatchCostCurve(batches=[2], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]]])
    curve = VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), batch, timed_rounds=8)

    def pair_member(seconds: list[float]) -> GenerationStats:
        """One of two sequences that shared every forward: each records the same shapes and times."""
        stats = GenerationStats(rounds=len(seconds), tree_sizes=[0] * len(seconds))
        stats.accepted_nodes = [[] for _ in seconds]
        stats.verify_contexts, stats.verify_seconds = [100] * len(seconds), seconds
        stats.verify_forwards = [(2, 2, 100)] * len(seconds)
        return stats

    early = [0.01 * (1 + i / 100) for i in range(12)]
    for _ in range(2):  # both sequences of the pair finish: the forwards count once
        rounds.observe_generation(pair_member(early))
    assert len(rounds._batch_forwards[False]) == 4  # steady: all but the eight after the prompt
    late = [0.03 * (1 + i / 100) for i in range(13)]
    rounds.observe_generation(pair_member(late))
    assert len(rounds._batch_forwards[False]) == 8  # the oldest forward makes room
    assert rounds.batch_scale(2) == pytest.approx(np.median([s / 0.01 for s in early[9:] + late[8:]]))


def test_the_batch_curve_is_measured_on_the_first_shared_round_only():
    from diffdraft.budget.batch_cost import BatchCostCurve

    loads = []

    def load() -> BatchCostCurve:
        loads.append(1)
        return BatchCostCurve(batches=[2], sizes=[1, 8], contexts=[100], seconds=[[[0.01, 0.02]]])

    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), load)
    solo = GenerationStats(rounds=2, tree_sizes=[3, 2], accepted_nodes=[[], []])
    solo.verify_contexts, solo.verify_seconds, solo.verify_forwards = [100] * 2, [0.01] * 2, [(1, 4, 100)] * 2
    rounds.observe_generation(solo)
    rounds.plan([RoundSequence(GenerationStats(), 100, True)])
    assert not loads  # a process that never batches never measures
    rounds.plan([RoundSequence(GenerationStats(), 100, True)] * 2)
    rounds.plan([RoundSequence(GenerationStats(), 100, True)] * 2)
    assert loads == [1]


class FixedPlan:
    """A round planner that gives every sequence the budgets of ``pattern`` in turn, by round, takes
    every offered copy whole when ``copies``, and says plain decoding settled in when ``settled``."""

    def __init__(self, pattern: list[int], copies: bool = False, settled: bool = False) -> None:
        self.pattern = pattern
        self.copies = copies
        self.settled = settled

    def plain_stands(self, sequences: int) -> bool:
        return False

    def plain_settled(self) -> bool:
        return self.settled

    def plan(self, sequences: list[RoundSequence]) -> list[int]:
        return [self.pattern[s.stats.rounds % len(self.pattern)] if s.can_draft else 0 for s in sequences]

    def copy_lengths(self, budgets, copies) -> list[int]:
        return [len(c) - 1 if self.copies and c is not None else 0 for c in copies]

    def build(self, tree_round: TreeRound):
        return DDTreeBuilder(tree_round.budget).build(tree_round)


def boosted_case(temperature: float):
    """A tiny target, a lookup-boosted drafter, requests, their sampling and their plain outputs."""
    target = tiny_target("qwen3", seed=8)
    drafter, _ = make_method("ddtree-4+pld", target, [], [], 5, 8)
    requests = requests_for(target, 8, 4)
    sampling = SamplingParams(temperature=temperature)
    plain = [
        alone(SpeculativeEngine(TargetModel(target), None, ChainBuilder()), r, sampling) for r in requests
    ]
    return target, drafter, requests, sampling, plain


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rounds_at_budget_0_are_plain_decoding_steps(temperature):
    target, drafter, requests, sampling, plain = boosted_case(temperature)
    never = SpeculativeEngine(TargetModel(target), drafter, FixedPlan([0]))
    stats = [GenerationStats() for _ in requests]
    assert batched(never, requests, sampling, 3, stats) == plain  # the same samples too, seed for seed
    assert [alone(never, r, sampling) for r in requests] == plain
    # no drafting paid: every round's root-only tree and mask are a plain step's
    assert all(s.timings["draft"] == s.draft_build_seconds == 0 and not any(s.tree_sizes) for s in stats)
    mixed = SpeculativeEngine(TargetModel(target), drafter, FixedPlan([0, 3, 0, 6]))
    each = [alone(mixed, r, sampling) for r in requests]
    assert batched(mixed, requests, sampling, 3) == each
    if temperature == 0:
        assert each == plain


def test_shared_rounds_without_a_tree_tap_nothing_once_plain_settled_in_and_change_no_output(monkeypatch):
    """Taps skipped in such rounds leave gaps in the drafter's context; its later trees draft across
    them, and the outputs stay the target's."""
    target, drafter, requests, sampling, plain = boosted_case(0.0)
    wrapped = TargetModel(target)
    engine = SpeculativeEngine(wrapped, drafter, FixedPlan([0, 0, 3, 0, 0, 0, 6], copies=True, settled=True))
    assert engine.untapped_plain
    plans, tapped = [], []
    make_plans, verify_batch = engine.plan, wrapped.verify_batch
    monkeypatch.setattr(engine, "plan", lambda sequences: plans.append(make_plans(sequences)) or plans[-1])
    monkeypatch.setattr(
        wrapped,
        "verify_batch",
        lambda inputs, layer_ids: tapped.append(layer_ids) or verify_batch(inputs, layer_ids),
    )
    stats = [GenerationStats() for _ in requests]
    assert batched(engine, requests, sampling, 3, stats) == plain
    untapped = [len(p) > 1 and all(plan.budget == 0 and plan.copy is None for plan in p) for p in plans]
    assert tapped == [[] if skip else engine.layer_ids for skip in untapped]
    assert 0 < sum(untapped) < len(untapped)
    first = untapped.index(True)
    assert any(plan.budget for p in plans[first + 1 :] for plan in p)  # trees drafted across the gaps
    assert any(s.copy_rounds for s in stats)


def test_only_a_round_planner_with_a_drafter_that_tolerates_gaps_may_skip_taps():
    target = tiny_target("qwen3", seed=4)
    wrapped = TargetModel(target)
    boosted, _ = make_method("ddtree-4+pld", target, [], [], 5, 4)
    dart = DARTDrafter(tiny_dart(target, seed=4), wrapped)
    assert SpeculativeEngine(wrapped, boosted, FixedPlan([0])).untapped_plain
    assert SpeculativeEngine(wrapped, boosted.drafter, FixedPlan([0])).untapped_plain
    assert not SpeculativeEngine(wrapped, boosted, DDTreeBuilder(4)).untapped_plain  # nothing plans rounds
    # DART's prefix rows must be contiguous; prompt lookup taps nothing anyway
    for drafter in (dart, LookupBoostedDrafter(dart), boosted.lookup):
        assert not SpeculativeEngine(wrapped, drafter, FixedPlan([0])).untapped_plain
    unsettled = SpeculativeEngine(wrapped, boosted, FixedPlan([0], settled=False))
    assert unsettled.round_layer_ids([PLAIN, PLAIN]) == unsettled.layer_ids
    settled = SpeculativeEngine(wrapped, boosted, FixedPlan([0], settled=True))
    assert settled.round_layer_ids([PLAIN, PLAIN]) == []
    assert settled.round_layer_ids([PLAIN]) == settled.layer_ids  # alone, a sequence keeps its taps
    assert settled.round_layer_ids([PLAIN, RoundPlan(3)]) == settled.layer_ids
    assert settled.round_layer_ids([PLAIN, RoundPlan()]) == settled.layer_ids  # the builder's own size
    copy = RoundPlan(0, Proposal(tokens=torch.tensor([3, 4])))
    assert settled.round_layer_ids([PLAIN, copy]) == settled.layer_ids  # timed with the trees' forwards


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_free_copies_in_rounds_without_a_tree_change_no_output(temperature):
    target, drafter, requests, sampling, plain = boosted_case(temperature)
    copying = SpeculativeEngine(TargetModel(target), drafter, FixedPlan([0, 0, 3], copies=True))
    stats = [GenerationStats() for _ in requests]
    each = [alone(copying, r, sampling) for r in requests]
    assert batched(copying, requests, sampling, 3, stats) == each  # the same samples too, seed for seed
    if temperature == 0:
        assert each == plain
    assert sum(len(s.copy_rounds) for s in stats) > 0  # copies were verified
    for s in stats:
        assert all(s.tree_sizes[i] > 0 for i in s.copy_rounds)
        assert len(rounds_of(s)) == s.rounds - len(s.copy_rounds)  # the planner learns no copy round
        assert s.drafter_sizes() == [0 if i in s.copy_rounds else n for i, n in enumerate(s.tree_sizes)]


class SlowPlan(FixedPlan):
    """:class:`FixedPlan` whose budgets take ``seconds`` to plan."""

    def __init__(self, seconds: float, pattern: tuple[int, ...] = (0,)) -> None:
        super().__init__(list(pattern), copies=True)
        self.seconds = seconds

    def plan(self, sequences: list[RoundSequence]) -> list[int]:
        time.sleep(self.seconds)
        return super().plan(sequences)


def test_copies_pay_their_rounds_whole_plan_in_a_batch_and_their_search_alone():
    """In a batch a copy ends a plain plan that would have stood, so the next round is planned anew:
    the copies of a round share its whole plan. Alone every round is planned anyway."""
    target, drafter, requests, sampling, plain = boosted_case(0.0)
    engine = SpeculativeEngine(TargetModel(target), drafter, SlowPlan(0.02))
    together = [GenerationStats() for _ in requests]
    assert batched(engine, requests, sampling, 3, together) == plain
    lone = [GenerationStats() for _ in requests]
    assert [alone(engine, r, sampling, s) for r, s in zip(requests, lone, strict=True)] == plain
    copied = [s for s in together if s.copy_rounds]
    assert copied and all(s.copy_plan_seconds >= 0.02 / 3 * len(s.copy_rounds) for s in copied)
    assert all((s.copy_plan_seconds > 0) == bool(s.copy_rounds) for s in together + lone)
    copied_alone = [s for s in lone if s.copy_rounds]
    assert copied_alone and all(s.copy_plan_seconds < 0.02 * len(s.copy_rounds) for s in copied_alone)


def test_drafting_pays_its_rounds_plan_in_a_batch_and_nothing_alone():
    """A batch's plan that drafts is made anew the next round (a plain one would have stood): the
    sequences that draft or copy share it, and the planner counts it in a drafting round's cost."""
    target, drafter, requests, sampling, plain = boosted_case(0.0)
    engine = SpeculativeEngine(TargetModel(target), drafter, SlowPlan(0.02, pattern=(0, 3)))
    together = [GenerationStats() for _ in requests]
    assert batched(engine, requests, sampling, 3, together) == plain
    lone = [GenerationStats() for _ in requests]
    assert [alone(engine, r, sampling, s) for r, s in zip(requests, lone, strict=True)] == plain
    assert all(s.draft_plan_seconds == 0.0 for s in lone)
    drafted = {  # in rounds shared with others: the last sequence left runs alone
        id(s): sum(n > 0 and f[0] > 1 for n, f in zip(s.drafter_sizes(), s.verify_forwards, strict=True))
        for s in together
    }
    assert any(drafted.values())
    assert all(s.draft_plan_seconds >= 0.02 / 3 * drafted[id(s)] for s in together)
    assert all((s.draft_plan_seconds > 0) == (drafted[id(s)] > 0) for s in together)
    # a drafter's trees and masks, not the plain rounds' root-only ones nor the copies'
    built = [s.timings["tree"] + s.timings["mask"] - s.copy_seconds for s in together]
    assert all((s.draft_build_seconds > 0) == any(s.drafter_sizes()) for s in together)
    assert all(s.draft_build_seconds <= b for s, b in zip(together, built, strict=True))
    assert sum(s.draft_build_seconds for s in together) < sum(built)
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    for s in together:
        rounds.observe_generation(s)
    assert rounds.draft_seconds(alone=False) >= 0.02 / 3


def test_a_round_where_not_even_the_copy_ceiling_pays_looks_for_no_copy(monkeypatch):
    from diffdraft.drafters.lookup_boost import LookupBoostedDrafter

    target, drafter, requests, sampling, plain = boosted_case(0.0)
    looked = []  # the sequences in the round of each lookup
    sharing = [0]
    offer = LookupBoostedDrafter.copy_offer
    monkeypatch.setattr(LookupBoostedDrafter, "copy_offer", lambda *a: looked.append(sharing[0]) or offer(*a))
    plan = SpeculativeEngine.plan

    def counted(engine, sequences):
        sharing[0] = len(sequences)
        return plan(engine, sequences)

    monkeypatch.setattr(SpeculativeEngine, "plan", counted)
    never = SpeculativeEngine(TargetModel(target), drafter, FixedPlan([0], copies=False))
    assert batched(never, requests, sampling, 3) == plain
    assert not [n for n in looked if n > 1]  # (a sequence left alone looks: see the next test)
    copying = SpeculativeEngine(TargetModel(target), drafter, FixedPlan([0], copies=True))
    assert batched(copying, requests, sampling, 3) == plain
    assert [n for n in looked if n > 1]


class CountingPlan(FixedPlan):
    """:class:`FixedPlan` that keeps every copy curve it was asked about, by round."""

    def __init__(self, copies: bool) -> None:
        super().__init__([0], copies=copies)
        self.asked: list[list] = []

    def copy_lengths(self, budgets, copies) -> list[int]:
        self.asked.append(list(copies))
        return super().copy_lengths(budgets, copies)


@pytest.mark.parametrize("copies", [False, True])
def test_a_sequence_alone_goes_straight_to_its_copy_offer_without_asking_the_ceiling(monkeypatch, copies):
    """Alone, the ceiling would cost as much as the lookup it spares and pays in most rounds: the plan
    asks once a round, about the offer, and takes the copies it would have taken."""
    from diffdraft.drafters.lookup_boost import LookupBoostedDrafter

    target, drafter, requests, sampling, plain = boosted_case(0.0)
    ceilings = []
    ceiling = LookupBoostedDrafter.copy_ceiling
    monkeypatch.setattr(LookupBoostedDrafter, "copy_ceiling", lambda *a: ceilings.append(1) or ceiling(*a))
    planner = CountingPlan(copies)
    engine = SpeculativeEngine(TargetModel(target), drafter, planner)
    stats = [GenerationStats() for _ in requests]
    assert [alone(engine, r, sampling, s) for r, s in zip(requests, stats, strict=True)] == plain
    assert not ceilings
    rounds = sum(s.rounds for s in stats)
    assert 0 < len(planner.asked) <= rounds  # at most once a round: rounds without an offer ask nothing
    assert all(curve is not None and curve[0] == 1.0 for [curve] in planner.asked)  # the offer's
    assert (sum(len(s.copy_rounds) for s in stats) > 0) == copies


def test_a_copy_plan_like_the_last_is_reused(monkeypatch):
    from diffdraft.budget import round_budget

    planned = []
    monkeypatch.setattr(round_budget, "plan_copies", lambda *args: planned.append(args) or [0])
    rounds = losing_planner()
    rounds.plan([RoundSequence(drafted_once(1), 100, True)])
    ceiling = [1.0, 1.5, 1.75]
    for _ in range(3):
        assert rounds.copy_lengths([0], [ceiling]) == [0]
    assert len(planned) == 1  # the same ceiling, budgets and costs: the last plan stands
    rounds.copy_lengths([0], [list(ceiling)])  # another list: planned anew
    assert len(planned) == 2


def test_copied_tokens_join_while_they_raise_the_rate_most_likely_first():
    taus = [[1.0, 1.6, 2.0], [1.0, 1.5, 1.7]]
    verify = 0.01 + 0.002 * np.arange(7)  # a token costs a fifth of a forward of one
    # the first sequence drafts 2 nodes; the second's copy: its first token pays, its second does not
    copy = [1.0, 1.6, 1.65, 1.66]
    assert plan_copies(taus, [2, 0], [None, copy], verify, 0.001, 0.0) == [0, 1]
    # unless building its chain and mask costs more than its first token gains
    assert plan_copies(taus, [2, 0], [None, copy], verify, 0.001, 0.0, copy_seconds=0.003) == [0, 0]
    # no copy for a sequence that drafts, and none that is not offered
    assert plan_copies(taus, [2, 1], [None, copy], verify, 0.001, 0.0) == [0, 0]
    assert plan_copies(taus, [0, 0], [None, None], verify, 0.001, 0.0) == [0, 0]
    # on a flat forward every copied token pays, but no more than the sequence's curve reaches
    assert plan_copies(taus, [0, 0], [copy, copy], np.full(7, 0.01), 0.001, 0.0) == [2, 2]
    # the best of two copies goes first
    weak = [1.0, 1.2]
    assert plan_copies(taus, [0, 0], [weak, copy], verify, 0.001, 0.0) == [0, 1]


def test_a_free_copy_costs_what_finished_copies_took_and_drafting_what_drafted_rounds_did():
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    assert rounds.copy_seconds() == 0.0  # copies get tried before any was measured
    stats = GenerationStats(rounds=4, tree_sizes=[3, 4, 2, 0], accepted_nodes=[[]] * 4, copy_rounds=[2])
    stats.verify_contexts, stats.verify_seconds = [100] * 4, [0.01] * 4
    stats.verify_forwards = [(1, 4, 100)] * 4
    stats.timings.update(draft=0.024, tree=0.006, mask=0.001, accept=0.0, commit=0.0)
    stats.catch_up_draft_seconds = [0.02]  # the prompt taken in: a one-off, not a drafting round's cost
    stats.copy_seconds = 0.002  # of the tree and mask time
    stats.draft_build_seconds = 0.004  # of the tree and mask time too (the plain round's took the rest)
    stats.copy_plan_seconds = 0.002  # of no stage
    rounds.observe_generation(stats)
    assert rounds.copy_seconds() == pytest.approx(0.004)
    # the second drafted round's forward (0.004) and each drafted round's tree and mask (0.004 / 2)
    assert rounds.draft_seconds() == pytest.approx(0.006)


def test_a_sequence_that_drafted_once_teaches_no_drafting_cost():
    """Its one drafting round took the prompt in: after a batch whose sequences drafted once each,
    that one-off would stand for every lone sequence's drafting round (budget 0 where drafting pays)."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    stats = GenerationStats(rounds=2, tree_sizes=[3, 0], accepted_nodes=[[], []])
    stats.verify_contexts, stats.verify_seconds, stats.verify_forwards = (
        [100] * 2,
        [0.01] * 2,
        [(8, 32, 100)] * 2,
    )
    stats.timings.update(draft=0.03, tree=0.001, mask=0.001)
    stats.catch_up_draft_seconds = [0.03]
    rounds.observe_generation(stats)
    assert rounds.draft_seconds(alone=True) == rounds.draft_seconds(alone=False) == 0.0


def finished(forwards: tuple[int, int, int], draft: float, commit: float = 0.0) -> GenerationStats:
    """A finished sequence of two drafting rounds of the ``forwards`` shape, each taking ``draft``
    seconds to draft and ``commit`` to commit."""
    stats = GenerationStats(rounds=2, tree_sizes=[3, 3], accepted_nodes=[[], []])
    stats.verify_contexts, stats.verify_seconds, stats.verify_forwards = [100] * 2, [0.01] * 2, [forwards] * 2
    stats.timings.update(draft=2 * draft, tree=0.0, mask=0.0, accept=0.0, commit=2 * commit)
    return stats


def test_a_lone_sequence_plans_with_the_stage_costs_of_sequences_that_ran_alone():
    """Drafting in a batch costs a sequence another time than drafting alone (its share of a batch's
    plan): a lone sequence after a busy spell must not plan with the batch's times, not even before
    a lone one finished (it stopped drafting when it did); a batch may read the lone ones' first."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    rounds.observe_generation(finished((8, 32, 100), draft=0.05))
    assert rounds.draft_seconds(alone=False) == pytest.approx(0.05)
    assert rounds.draft_seconds(alone=True) == 0.0
    batch_later = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    batch_later.observe_generation(finished((1, 4, 100), draft=0.002))
    assert batch_later.draft_seconds(alone=False) == pytest.approx(0.002)
    rounds.observe_generation(finished((1, 4, 100), draft=0.002))
    assert rounds.draft_seconds(alone=True) == pytest.approx(0.002)
    assert rounds.draft_seconds(alone=False) == pytest.approx(0.05)
    lone = GenerationStats(surrogates=[[1.0 + 0.3 * b for b in range(20)]])
    assert rounds.plan([RoundSequence(lone, 100, can_draft=True)]) != [0]


def test_a_few_sequences_that_ran_through_a_stall_do_not_move_the_stage_costs():
    """A stall of the machine slows every stage of the sequences running through it: by the mean, a
    handful of them read drafting several times dearer for a window of requests, and a lone
    sequence drafted far less where drafting paid."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    for draft in [0.002] * 7 + [0.05] * 3:
        rounds.observe_generation(finished((1, 4, 100), draft, commit=draft / 10))
    assert rounds.draft_seconds(alone=True) == pytest.approx(0.002)
    assert rounds.commit_seconds(alone=True) == pytest.approx(0.0002)
    for _ in range(4):  # half the window now: the middle of the two middle ones
        rounds.observe_generation(finished((1, 4, 100), 0.05, commit=0.005))
    assert rounds.draft_seconds(alone=True) == pytest.approx((0.002 + 0.05) / 2)


@pytest.mark.parametrize(("draft", "drafts"), [(0.001, True), (0.05, False)])
def test_the_first_lone_sequence_plans_with_its_own_drafting_time(draft, drafts):
    """Before any sequence finished, the record of drafting times is empty: a lone sequence's own
    drafted rounds stand in, so the first request of a process drafts where its drafter is cheap and
    decodes plainly where a drafter forward costs more than what it gains (it drafted all through)."""
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[100], seconds=[[0.01, 0.0163]])  # 0.1 ms a node
    rounds = RoundBudgetPlanner(BudgetPlanner(curve))
    stats = GenerationStats(surrogates=[[1.0 + 0.9 * min(b, 4) for b in range(20)]])
    for _ in range(8):
        verified(stats, nodes=4, accepted=[1, 2, 3], context=100, seconds=0.0104)
    stats.timings["draft"] = 8 * draft
    stats.catch_up_draft_seconds = [draft]  # one run: the first round took the prompt in
    assert rounds.draft_seconds() == 0.0  # nothing finished: the record is empty
    [budget] = rounds.plan([RoundSequence(stats, 100, can_draft=True)])
    assert (budget > 0) == drafts


@pytest.mark.parametrize("outside", [0.0, 0.01])
def test_the_first_lone_sequence_plans_with_its_own_time_outside_its_stages(outside):
    """Before a lone sequence finished, the record of time outside the stages is empty (a server's
    first lone request, or its first after a load of batches): a lone sequence's own wall time so far
    stands in, so it drafts where rounds of 10 ms outside their stages make drafting pay (as
    :func:`test_a_lone_round_pays_the_time_its_sequence_spent_in_no_stage` from the record), until it
    shares a round (its wall time then holds the others' stages)."""
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[100], seconds=[[0.01, 0.0163]])  # 0.1 ms a node
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), explore_alone=1000)
    rounds.observe_generation(finished((8, 32, 100), draft=0.006, commit=0.0005))  # a batch's: unread
    stats = GenerationStats(surrogates=[[1.0 + 0.15 * min(b, 2) for b in range(20)]])
    for _ in range(8):
        verified(stats, nodes=4, accepted=[1], context=100, seconds=0.0104)
    stats.timings.update(draft=8 * 0.006, commit=8 * 0.0005)
    stats.catch_up_draft_seconds = [0.006]  # one run: 0.006 s a drafted round within it
    stats.started = time.perf_counter() - sum(stats.timings.values()) - stats.rounds * outside
    [budget] = rounds.plan([RoundSequence(stats, 100, can_draft=True)])
    assert (budget > 0) == (outside > 0)
    assert rounds._round[2] == OwnRounds(0.006, pytest.approx(0.0005 + outside, abs=2e-4))
    stats.verify_forwards[0] = (2, 10, 100)
    assert OwnRounds.of(stats, draft=True, outside=True).outside is None


def test_a_lone_sequence_keeps_only_its_latest_own_costs():
    """Its own costs are read anew every few rounds and key the round's costs: a long first request
    must not keep one set of costs per reading for as long as it runs."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    taus = [[1.0, 1.9, 2.5]]
    from_record = rounds.round_costs(taus, 100)
    for i in range(1, 50):
        latest = rounds.round_costs(taus, 100, own=OwnRounds(0.001 * i, 0.0005))
        assert latest[1:] == pytest.approx((0.001 * i, 0.0005))
    assert rounds.round_costs(taus, 100, own=OwnRounds(0.049, 0.0005)) is latest  # still cached
    assert rounds.round_costs(taus, 100) is from_record  # the record's costs are not a reading's
    assert len(rounds._costs) == 2


def test_a_lone_sequence_pays_a_run_s_entry_only_to_start_one_and_a_batch_every_time():
    """Entering a run of drafted rounds costs the drafter's catch-up and the aftermath once: a lone
    sequence that drafted last round continues at a round's cost, one that did not pays the entry
    spread over a refresh's rounds, and a batch's sequence, drafting now and then, pays it whole."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])), refresh=8)
    rounds._draft_seconds.add(True, 0.002)
    rounds._entry_seconds.add(True, 0.016)
    taus = [[1.0, 1.9, 2.5]]
    assert rounds.round_costs(taus, 100)[1] == pytest.approx(0.002)
    assert rounds.round_costs(taus, 100, entering=True)[1] == pytest.approx(0.002 + 0.016 / 8)
    assert rounds.round_costs(taus * 2, 100, entering=True)[1] == pytest.approx(0.002 + 0.016)
    # planned: a 12 ms drafting round pays within a run, not with a 200 ms entry's eighth on top
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[100], seconds=[[0.01, 0.0163]])  # 0.1 ms a node
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), explore_alone=1000)
    rounds._draft_seconds.add(True, 0.012)
    rounds._entry_seconds.add(True, 0.2)
    stats = GenerationStats(surrogates=[[1.0 + 0.9 * min(b, 4) for b in range(20)]])
    for _ in range(8):
        verified(stats, nodes=4, accepted=[1, 2, 3], context=100, seconds=0.0104)
    assert rounds.plan([RoundSequence(stats, 100, can_draft=True)]) != [0]
    verified(stats, nodes=0, accepted=[], context=100, seconds=0.01)
    assert rounds.plan([RoundSequence(stats, 100, can_draft=True)]) == [0]


def test_every_variant_of_a_round_reads_the_same_forward():
    """A lone round that would start a run of drafted rounds and one that would go on with it differ
    in their drafting cost only: each reading its own forward, made when first asked from records a
    few finished sequences apart, a lone request alternated plain and drafted rounds."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    rounds._draft_seconds.add(True, 0.002)
    taus = [[1.0, 1.9, 2.5]]
    entering = rounds.round_costs(taus, 100, entering=True)
    going_on = rounds.round_costs(taus, 100, entering=False)
    assert entering[0] is going_on[0]
    assert rounds.round_costs(taus, 100, own=OwnRounds(0.003, 0.001))[0] is going_on[0]
    assert rounds.round_costs(taus * 2, 100)[0] is not going_on[0]  # another shape, its own forward


@pytest.mark.parametrize("outside", [0.0, 0.01])
def test_a_lone_round_pays_the_time_its_sequence_spent_in_no_stage(outside):
    """A lone sequence's wall time outside its stages (the loop around them: the plan, stop checks,
    a server's stream) is paid every round whatever it verifies, so it weighs against drafting's gain
    as a round's fixed time; in a batch a sequence's wall time is the whole batch's and is not read."""
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[100], seconds=[[0.01, 0.0163]])  # 0.1 ms a node
    rounds = RoundBudgetPlanner(BudgetPlanner(curve), explore_alone=1000)
    lone = finished((1, 4, 100), draft=0.006, commit=0.0005)
    lone.total_seconds = sum(lone.timings.values()) + lone.rounds * outside
    shared = finished((2, 8, 100), draft=0.006, commit=0.0005)
    shared.total_seconds = 1.0
    rounds.observe_generation(lone)
    rounds.observe_generation(shared)
    assert rounds.commit_seconds(alone=True) == pytest.approx(0.0005 + outside)
    assert rounds.commit_seconds(alone=False) == pytest.approx(0.0005)
    # about 1.5 tokens expected from 2 nodes: 1.53 / (10.1 + 6 + 0.5 ms) loses to 1 / 10.5 ms, and
    # wins once both rounds also pay 10 ms outside their stages
    stats = GenerationStats(surrogates=[[1.0 + 0.15 * min(b, 2) for b in range(20)]])
    for _ in range(8):
        verified(stats, nodes=4, accepted=[1], context=100, seconds=0.0104)
    [budget] = rounds.plan([RoundSequence(stats, 100, can_draft=True)])
    assert (budget > 0) == (outside > 0)
