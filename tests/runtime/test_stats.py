"""Stage timers: wall time per stage, split among the sequences that shared it, and profiler ranges
only while a profiler records."""

from __future__ import annotations

import time

import torch

from diffdraft.runtime.stats import GenerationStats, StageTimer


def test_a_shared_stage_is_split_evenly_and_named_in_a_profile():
    together = [GenerationStats(), GenerationStats()]
    timer = StageTimer(together, torch.device("cpu"))
    with timer("draft"):
        time.sleep(0.01)
    assert timer.last >= 0.01
    assert all(s.timings["draft"] == timer.last / 2 for s in together)
    with torch.profiler.profile() as profile, timer("verify"):
        torch.ones(4).sum()
    assert "diffdraft.verify" in {event.name for event in profile.events()}
    assert all(s.timings["verify"] > 0 for s in together)


def test_the_surrogate_gains_are_the_mean_of_what_each_surrogate_adds_per_rank_as_they_come():
    stats = GenerationStats(surrogates=[[1.0, 1.5, 1.75]])
    assert stats.surrogate_gains() == [0.5, 0.25]
    stats.surrogates.append([1.0, 1.25, 1.5, 1.625, 1.75])  # a longer tree: the first adds nothing past 2
    assert stats.surrogate_gains() == [0.375, 0.25, 0.0625, 0.0625]
    stats.surrogates = [[1.0, 2.0]]  # replaced, not appended to: summed anew
    assert stats.surrogate_gains() == [1.0]


def test_the_drafter_built_the_last_round_only_where_it_drafted_a_tree_that_was_no_copy():
    stats = GenerationStats()
    assert not stats.drafted_last_round()  # nothing verified yet: a first drafting round catches up
    stats.tree_sizes = [3]
    assert stats.drafted_last_round()
    stats.tree_sizes, stats.copy_rounds = [3, 2], [1]
    assert not stats.drafted_last_round()  # prompt lookup's copy: the drafter saw none of it
    stats.tree_sizes, stats.copy_rounds = [3, 2, 0], [1]
    assert not stats.drafted_last_round()
