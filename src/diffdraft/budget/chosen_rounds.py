"""What the rounds a plan chose to draft accepted, against what it expected of them.

A plan drafts in the rounds whose estimated acceptance is highest, and an estimate that is high partly
by noise realizes less (the winner's curse). On a small CPU the rounds the plan chose to draft
accepted less than it expected, while its explorations, drafted whatever the estimate said, accepted
as much or more, and the chosen rounds' tokens per second came out no better than plain decoding's
(docs/decisions.md, "drafting gains scaled by what chosen rounds realized"). So the gains the plan
expects of drafting are scaled by the share of them the chosen rounds realized.
"""

from __future__ import annotations

from collections import deque

from diffdraft.runtime.stats import GenerationStats

WINDOW = 64
"""Finished sequences that drafted whose chosen rounds the calibration reads, the latest. A sequence
that drafted only to explore counts too: once the plans stop choosing to draft, the rounds that made
them stop age out and the factor returns to 1, so drafting is tried again now and then (a factor
kept for good would keep a plan from drafting for good, after a few sequences the drafter served
badly)."""
MIN_ROUNDS = 16
"""Chosen rounds it needs before it scales anything."""


class ChosenRounds:
    """The realized share of the expected gain (acceptance length past the bonus token) over the
    chosen drafted rounds of the latest finished sequences that drafted, at most 1 (:attr:`factor`)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._sequences: deque[tuple[int, float, float]] = deque(maxlen=window)
        """Per finished sequence that drafted: its chosen rounds, their expected and realized gains
        summed."""
        self.factor = 1.0

    def observe(self, stats: GenerationStats) -> None:
        """Learn a finished sequence's chosen rounds (:attr:`~GenerationStats.chosen_rounds`), each
        expected at the size of the tree its drafter built (a tree can come out smaller than its
        budget); a round that verified a free copy or no tree taught nothing of its drafter, and a
        sequence whose drafter built no tree teaches nothing."""
        sizes, lengths = stats.drafter_sizes(), stats.acceptance_lengths
        if not any(sizes):
            return
        rounds, expected, realized = 0, 0.0, 0.0
        for index, taus in stats.chosen_rounds:
            if index < min(len(sizes), len(lengths)) and sizes[index] > 0:
                rounds += 1
                expected += taus[min(sizes[index], len(taus) - 1)] - 1.0
                realized += lengths[index] - 1.0
        self._sequences.append((rounds, expected, realized))
        rounds, expected, realized = (sum(column) for column in zip(*self._sequences, strict=True))
        fitted = rounds >= MIN_ROUNDS and expected > 0
        self.factor = min(1.0, realized / expected) if fitted else 1.0

    def calibrated(self, taus: list[float]) -> list[float]:
        """``taus`` (expected acceptance length per budget, 1 at budget 0) with every gain scaled by
        :attr:`factor`; the same list when it is 1."""
        if self.factor == 1.0:
            return taus
        return [1.0, *(1.0 + self.factor * (tau - 1.0) for tau in taus[1:])]
