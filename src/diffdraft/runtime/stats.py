"""Per-generation statistics: acceptance and where the time went."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from itertools import pairwise

import torch

STAGES = ("prefill", "draft", "tree", "mask", "verify", "accept", "commit")
"""verify is the target forward alone; mask builds its tree mask, accept walks the result."""


@dataclass
class TauEstimate:
    """A round planner's expected acceptance length per budget for one sequence, with what it was
    estimated from and what happened since, counted as rounds come (the planner asks every round, and
    rescanning every round since the estimate cost a batch-6 round a visible share of its time)."""

    taus: list[float]
    start: int
    """The sequence's rounds when it was estimated."""
    surrogates: int
    taught: int
    """The finished sequences that had taught the planner acceptance then."""
    checked: int
    """The first round not yet counted into :attr:`drafted` and :attr:`skipped` (from ``start - 1``)."""
    estimated: list[float]
    """The planner's estimate before the chosen rounds' calibration scaled it into :attr:`taus`
    (:class:`~diffdraft.budget.chosen_rounds.ChosenRounds`: what those rounds are compared against)."""
    alone: bool
    """Whether the sequence ran alone then (lone and shared rounds' calibrations are apart)."""
    drafted: int = 0
    """Rounds from :attr:`start` on whose tree the drafter built."""
    skipped: bool = False
    """Whether a round from ``start - 1`` on (around or since the estimate) verified no drafter's tree."""

    def count(self, sizes: Sequence[int]) -> None:
        """Count the rounds from :attr:`checked` on, ``sizes`` being their drafter's tree sizes (0: it
        built none)."""
        self.drafted += sum(size > 0 for size in sizes[max(0, self.start - self.checked) :])
        self.skipped = self.skipped or 0 in sizes
        self.checked += len(sizes)


@dataclass
class GenerationStats:
    rounds: int = 0
    """Verification forwards after the prefill."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Tokens committed per round, counting the bonus token (1 = nothing accepted)."""
    accepted_nodes: list[list[int]] = field(default_factory=list)
    """Per round, the tree indices of the accepted draft nodes (root excluded; best-first order
    for DDTree, depth for chains): what the auto budget learns smaller trees' acceptance from."""
    draft_depths: list[int] = field(default_factory=list)
    """Positions the drafter proposed per round (per-position acceptance needs the denominator)."""
    tree_sizes: list[int] = field(default_factory=list)
    """Drafted nodes verified per round (the root not counted)."""
    copy_rounds: list[int] = field(default_factory=list)
    """The rounds (indices, rising) whose tree was prompt lookup's free copy, verified instead of a
    drafter's tree when the round plan left the sequence without one: the auto budget learns the
    drafter's acceptance from the other rounds only (:meth:`drafter_sizes`)."""
    verify_seconds: list[float] = field(default_factory=list)
    """Per round, seconds of the target's verification forward (what the auto budget calibrates t on)."""
    verify_contexts: list[int] = field(default_factory=list)
    """Per round, the cached tokens its verification attended over (t depends on them as on the size)."""
    verify_forwards: list[tuple[int, int, int]] = field(default_factory=list)
    """Per round, the shape of the verification forward it shared: (sequences, tokens, mean cached
    tokens per sequence); verify_seconds is that whole forward's time, so a batch's cost is learned
    from its own shape, never mistaken for one tree's."""
    budgets: list[int] = field(default_factory=list)
    """Per tree the auto budget built, the node budget it had chosen for this sequence (its exploring
    rounds verify a little more or less: see tree_sizes); empty for fixed-size builders."""
    surrogates: list[list[float]] = field(default_factory=list)
    """The drafter's promised acceptance per budget on each of the auto budget's refresh rounds: the
    sequence's own prior while it runs, and what the planner learns from once it finished (a planner
    input, so not in :meth:`to_dict`)."""
    _surrogate_sums: tuple[list[list[float]], int, list[float]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    """(:attr:`surrogates` as last read, how many of them were summed, their gains per node rank summed)
    for :meth:`surrogate_gains`; started over when the list is replaced."""
    fruitless_explorations: int = 0
    """In a batch, the explorations since this sequence last drafted of its own accord: each doubles
    the round planner's interval to its next one (a planner input, so not in :meth:`to_dict`)."""
    chosen_rounds: list[tuple[int, list[float]]] = field(default_factory=list)
    """The rounds (indices) whose tree the round planner chose to draft, not to explore, each with the
    acceptance length per budget it expected before calibration: what it learns the estimates' bias
    from once the sequence finished (a planner input, so not in :meth:`to_dict`)."""
    tau_estimate: TauEstimate | None = None
    """The round planner's expected acceptance length per budget for this sequence (re-estimated
    every few drafted rounds: a planner input, so not in :meth:`to_dict`)."""
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    """Seconds spent per stage over the whole generation."""
    catch_up_draft_seconds: list[float] = field(default_factory=list)
    """Per run of drafted rounds (a drafted round after one whose tree the drafter did not build, the
    first included), that round's share of the draft stage: the drafter takes in what it has not seen
    yet, the whole prompt on the first (DFlash projects its taps, DART makes its prefix rows, DEER runs
    its model over it), the tokens of the rounds since it last drafted on the others. A one-off per
    run, which the round planner charges apart from what a drafted round costs within a run
    (:class:`~diffdraft.budget.round_budget.DraftingCost`)."""
    copy_seconds: float = 0.0
    """Seconds spent taking free copies and building their chains and masks (in the tree and mask
    stages too): what the auto budget weighs a copy's first token against."""
    draft_build_seconds: float = 0.0
    """Seconds spent building the drafter's trees and their masks (in the tree and mask stages too):
    with the draft stage, what a drafting round adds to a plain one, whose root-only tree and mask
    every round pays (charged to the drafted rounds, they made a batch's rare drafting round look
    several times its cost)."""
    copy_plan_seconds: float = 0.0
    """This sequence's share of the round plans that gave it a free copy (in no stage): in a batch a
    copy ends a plain plan that would have stood (the next round is planned anew), so the round's
    copies and trees share its whole plan; alone, where every round is planned, what looking for
    the copy took."""
    draft_plan_seconds: float = 0.0
    """In a batch, this sequence's share of the round plans that had it draft (in no stage): a plan
    that leaves the batch plain stands for several rounds, one that drafts is made anew each round."""
    started: float = 0.0
    """``time.perf_counter()`` when the sequence's prefill began: while it runs, its wall time so far
    (:attr:`total_seconds` is set once it ends), which the auto budget reads of a lone request before
    any finished (:class:`~diffdraft.budget.round_budget.OwnRounds`)."""
    total_seconds: float = 0.0
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """Mean acceptance length, bonus token included (the papers' tau)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def drafted_last_round(self) -> bool:
        """Whether the drafter built the tree of the sequence's latest round (not a free copy's)."""
        last = len(self.tree_sizes) - 1
        return (
            last >= 0
            and self.tree_sizes[last] > 0
            and not (self.copy_rounds and self.copy_rounds[-1] == last)
        )

    def drafter_sizes(self, start: int = 0) -> list[int]:
        """:attr:`tree_sizes` from round ``start`` on, a free copy's round counted 0: the nodes the
        drafter's own trees verified."""
        sizes = self.tree_sizes[start:]
        for index in reversed(self.copy_rounds):
            if index < start:
                break
            sizes[index - start] = 0
        return sizes

    def surrogate_gains(self) -> list[float]:
        """Per node rank 1, 2, ... (as far as the longest of :attr:`surrogates` reaches), the mean over
        the surrogates of what each promised that rank adds (nothing past its own tree). Summed as
        surrogates come: the auto budget reads it every few rounds, and averaging every surrogate anew
        each time was a large share of each re-estimate (docs/decisions.md, "the surrogate sums the
        heap's scores")."""
        summed, count, sums = self._surrogate_sums or (self.surrogates, 0, [])
        if summed is not self.surrogates:
            count, sums = 0, []
        for surrogate in self.surrogates[count:]:
            sums.extend([0.0] * (len(surrogate) - 1 - len(sums)))
            for rank, (before, after) in enumerate(pairwise(surrogate)):
                sums[rank] += after - before
        self._surrogate_sums = (self.surrogates, len(self.surrogates), sums)
        return [total / len(self.surrogates) for total in sums]

    @property
    def acceptance_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_lengths": self.acceptance_lengths,
            "accepted_nodes": self.accepted_nodes,
            "draft_depths": self.draft_depths,
            "tree_sizes": self.tree_sizes,
            "copy_rounds": self.copy_rounds,
            "verify_seconds": self.verify_seconds,
            "verify_contexts": self.verify_contexts,
            "verify_forwards": self.verify_forwards,
            "budgets": self.budgets,
            "acceptance_histogram": {str(k): v for k, v in self.acceptance_histogram.items()},
            "timings": dict(self.timings),
            "total_seconds": self.total_seconds,
            "stop_reason": self.stop_reason,
        }


class StageTimer:
    """Adds wall time to ``stats.timings[stage]``; synchronizes CUDA so GPU time is not misattributed.
    A stage several sequences ran together (one drafter forward for all) is split evenly among
    their stats, so each sequence's timings still add up to the wall time it is charged.

    Under ``torch.profiler`` each stage is also a range named ``diffdraft.<stage>``, so a profile of a
    generation groups its operators by stage. The range is opened only while a profiler records: a
    range costs time even with no profiler running, and a batch times several stages per sequence
    every round (docs/decisions.md, "profiler ranges only while a profiler records")."""

    def __init__(self, stats: GenerationStats | Sequence[GenerationStats], device: torch.device) -> None:
        self.shares = [stats] if isinstance(stats, GenerationStats) else list(stats)
        self.sync = device.type == "cuda"
        self.last = 0.0
        """Seconds of the stage timed last."""

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        begin = time.perf_counter()
        named = torch.profiler.record_function(f"diffdraft.{stage}") if _profiling() else nullcontext()
        with named:
            yield
            if self.sync:
                torch.cuda.synchronize()
        self.last = time.perf_counter() - begin
        for stats in self.shares:
            stats.timings[stage] += self.last / len(self.shares)


def _profiling() -> bool:
    """Whether a torch profiler is recording."""
    return torch._C._autograd._profiler_enabled()
