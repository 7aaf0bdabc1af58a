"""The plain forwards a drafted round slows, told from a sequence's steady ones."""

from __future__ import annotations

import pytest

from diffdraft.budget.aftermath import AFTERMATH_ROUNDS, aftermath_seconds, plain_forwards
from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.budget.round_budget import RoundBudgetPlanner
from diffdraft.runtime.stats import GenerationStats

STEADY = 0.003


def sequence(rounds: list[tuple[str, float]], sequences: int = 1) -> GenerationStats:
    """A finished sequence of ``rounds`` (kind: "plain", "drafted", "copy" or "wide", another
    sequence's tree in a shared forward; the forward's seconds), ``sequences`` sharing each forward."""
    stats = GenerationStats()
    for kind, seconds in rounds:
        if kind == "copy":
            stats.copy_rounds.append(len(stats.tree_sizes))
        stats.tree_sizes.append(0 if kind in ("plain", "wide") else 3)
        tokens = sequences if kind == "plain" else sequences + 3
        stats.verify_forwards.append((sequences, tokens, 100))
        stats.verify_seconds.append(seconds)
    stats.accepted_nodes = [[] for _ in rounds]
    stats.verify_contexts = [100] * len(rounds)
    stats.rounds = len(rounds)
    return stats


def aftermath(stats: GenerationStats) -> float:
    return aftermath_seconds(stats, plain_forwards(stats))


def plain(count: int, seconds: float = STEADY) -> list[tuple[str, float]]:
    return [("plain", seconds)] * count


SLOWED = [("plain", STEADY + 0.0012), ("plain", STEADY + 0.0006), ("plain", STEADY + 0.0002)]


def test_the_plain_forwards_after_a_drafted_round_count_past_the_steady_ones():
    stats = sequence([*plain(10), ("drafted", 0.006), *SLOWED, *plain(20)])
    assert aftermath(stats) == pytest.approx(0.002)


def test_a_drafted_round_near_the_prompt_counts_nothing():
    """The forwards after the prefill run slow whatever the rounds do."""
    stats = sequence([("drafted", 0.006), *SLOWED, *plain(20)])
    assert aftermath(stats) == 0.0


def test_too_few_steady_forwards_tell_nothing():
    stats = sequence([*plain(10), ("drafted", 0.006), *SLOWED, *plain(AFTERMATH_ROUNDS)])
    assert aftermath(stats) == 0.0  # the last plain rounds are within reach of the drafting


def test_a_lone_copy_neither_ends_the_count_nor_is_timed_as_plain():
    stats = sequence([*plain(10), ("drafted", 0.006), SLOWED[0], ("copy", 0.005), *SLOWED[1:], *plain(20)])
    assert aftermath(stats) == pytest.approx(0.002)


def test_another_sequences_tree_ends_the_count_and_each_batch_size_has_its_own_steady_time():
    """Shared forwards: a wide one this sequence did not draft may be another's drafting, whose
    aftermath that sequence counts; forwards of another number of sequences start afresh."""
    rounds = [*plain(10), ("drafted", 0.006), SLOWED[0], ("wide", 0.006), *SLOWED[1:], *plain(20)]
    assert aftermath(sequence(rounds, sequences=2)) == pytest.approx(0.0012)
    lone = sequence(plain(12, 0.001))
    shared = sequence([*plain(10), ("drafted", 0.006), *SLOWED, *plain(20)], sequences=2)
    for name in ("tree_sizes", "verify_forwards", "verify_seconds", "accepted_nodes", "verify_contexts"):
        setattr(shared, name, getattr(lone, name) + getattr(shared, name))
    assert aftermath(shared) == pytest.approx(0.002)


def test_a_run_of_drafted_rounds_pays_its_catch_up_and_aftermath_once():
    """A drafted round within a run costs its own forward; entering a run costs the drafter's catch-up
    over the tokens it missed and the slowed plain forwards after the run, once a run."""
    rounds = RoundBudgetPlanner(BudgetPlanner(VerifyCostCurve([1, 64], [100], [[0.01, 0.02]])))
    runs = [("drafted", 0.006)] * 2
    stats = sequence([*plain(10), *runs, *SLOWED, *plain(10), *runs, *plain(20)])
    stats.catch_up_draft_seconds = [0.002, 0.003]  # the prompt taken in (a one-off), then a catch-up
    stats.timings.update(draft=0.002 + 0.001 + 0.003 + 0.001)
    rounds.observe_generation(stats)
    assert rounds.draft_seconds() == pytest.approx(0.001)
    # the catch-up's 0.003 - 0.001 and the slowed forwards' 0.002 over both runs
    assert rounds.entry_seconds() == pytest.approx(0.002 + 0.001)
