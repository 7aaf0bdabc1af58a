"""The DDTree budget that buys the most tokens per second, from the cost curve and acceptance.

The drafter's side is the DDTree surrogate: the optimal B-node tree's expected acceptance length is
1 + the sum of its B prefix probabilities, which the best-first order gives for every B at once.
Drafters are rarely calibrated, so what the target accepted in recent rounds replaces the surrogate
wherever it can (:class:`BudgetPlanner`); with t, the verification cost curve of
:mod:`diffdraft.budget.cost` rescaled by the rounds' own times (:meth:`BudgetPlanner.cost`), the
round planner (:mod:`diffdraft.budget.round_budget`) picks the budgets that buy the most tokens per
second.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from diffdraft.budget.aftermath import plain_forwards
from diffdraft.budget.cost import MAX_BUDGET, VerifyCostCurve
from diffdraft.runtime.stats import GenerationStats


def surrogate_acceptance(prefix_log_probs: Sequence[float]) -> list[float]:
    """Expected acceptance length (bonus included) of the first B nodes of a best-first DDTree, per B.

    ``prefix_log_probs`` are the tree's nodes' prefix log-probabilities under the factorized surrogate
    of the drafter's proposal, root (0) first, in the tree's best-first order
    (:meth:`~diffdraft.trees.DDTreeBuilder.ranked`): entry B is ``1 + the sum of the first B prefix
    probabilities``, entry 0 is 1 (the bonus token alone). Best-first order makes every prefix of the
    node list the optimal tree of that size.
    """
    return list(accumulate((math.exp(score) for score in prefix_log_probs[1:]), initial=1.0))


@dataclass(frozen=True)
class ObservedRound:
    """What one verified round teaches the planner."""

    budget: int
    """Draft nodes the round verified (its tree may have been cut short of the budget asked)."""
    accepted: Sequence[int]
    """Best-first indices of the draft nodes the target accepted."""
    context: int = 0
    """Cached tokens the round verified over."""
    seconds: float = 0.0
    """Its verification forward; 0 when not timed."""
    forward: tuple[int, int, int] | None = None
    """The forward's shape when several sequences shared it: (sequences, tokens, mean cached tokens);
    None when the round's tree was verified alone."""


def rounds_of(stats: GenerationStats) -> list[ObservedRound]:
    """A sequence's verified rounds as the planner learns from them: every list is one entry per
    round, recorded by the round itself, so nothing from another sequence can be mixed in. Rounds
    that verified a free copy are left out: their nodes are no DDTree's best-first ranks. A plain
    round (no tree) counts as timed only where it ran steady (:attr:`PlainForwards.steady`): the
    cost curve's one-token rounds are timed in a run, as plain decoding runs
    (:func:`~diffdraft.budget.cost.measure_verify_cost`), and those within a few rounds after
    drafting, whose drafter pushed the target's weights out of a CPU's cache, took longer
    (docs/decisions.md, "plain rounds timed where they run steady")."""
    copies = set(stats.copy_rounds)
    steady = plain_forwards(stats).steady
    return [
        _observed(stats, index, steady[index])
        for index in range(len(stats.tree_sizes))
        if index not in copies
    ]


def latest_drafted(stats: GenerationStats, count: int) -> list[int]:
    """The indices of the last ``count`` rounds whose drafter built a tree (:func:`rounds_of`'s with
    budget > 0), rising, read from the end: a running sequence is asked for them every few rounds,
    and under load most of its rounds drafted nothing."""
    sizes = stats.drafter_sizes()
    latest = []
    for index in range(len(sizes) - 1, -1, -1):
        if len(latest) == count:
            break
        if sizes[index] > 0:
            latest.append(index)
    return latest[::-1]


def _observed(stats: GenerationStats, index: int, steady: bool) -> ObservedRound:
    forward = stats.verify_forwards[index]
    plain = stats.tree_sizes[index] == 0
    return ObservedRound(
        stats.tree_sizes[index],
        stats.accepted_nodes[index],
        stats.verify_contexts[index],
        stats.verify_seconds[index] if steady or not plain else 0.0,
        None if forward[0] == 1 else tuple(forward),
    )


PRIOR_ROUNDS = 16
"""Weight, in rounds, of a prior estimate of a node rank's gain against the rounds that measured it:
the surrogate's promise against the finished rounds, and that estimate against a sequence's own."""
OWN_ROUNDS = 32
"""A running sequence's drafted rounds its estimate reads, the latest: what the drafter gets right
changes along a text (prose, then a list, then code), and a sequence that stopped drafting must be
able to start again from the few rounds it drafts to explore."""
MIN_TIMED_ROUNDS = 4
"""Rounds of one verified size before their times recalibrate the cost curve."""


class BudgetPlanner:
    """Chooses the DDTree budget from the cost curve and the drafter's recent proposals and rounds.

    Acceptance: best-first order numbers every node after its parent, so a round verified at
    budget B would have accepted, with only its first r <= B nodes, exactly its accepted nodes
    numbered <= r (greedy verification walks the same target choices). The gain of node rank r is
    therefore measured by every recent round that verified r nodes or more, and those measurements
    outweigh the drafter's surrogate as they accumulate (:data:`PRIOR_ROUNDS`). The surrogate,
    scaled by the share of its promise the target confirmed over the upper half of the
    well-measured ranks (at most 1), covers ranks few rounds reached: drafters are rarely
    calibrated, and the nodes past the budget are their weakest guesses. :class:`AutoBudgetBuilder`
    verifies a bigger tree now and then so the ranks just past the budget get measured too.

    Per sequence: the planner learns from finished sequences only, and chooses for one running
    sequence from its own record (:class:`~diffdraft.runtime.stats.GenerationStats`): that sequence's
    surrogates replace the recent ones as the prior, and its own latest drafted rounds
    (:data:`OWN_ROUNDS`) outweigh the finished rounds' estimate as they add up, so sequences the
    drafter serves well and badly get different budgets in one batch, each the one it would get alone.

    Cost: the cached curve was measured once, in isolation, and its shape can differ from what the
    same forwards cost inside a decoding loop (seen here on a CPU: a different cost per extra token;
    docs/decisions.md, "cost curve rescaled by the rounds' own times"). The
    recent rounds' verification times, divided by the curve's prediction for their size and
    context, give a scale per verified size; a line through those scales (weighted by rounds,
    constant outside the verified sizes) rescales the curve. The builder verifies smaller and
    bigger trees now and then, so the line's slope is measured around the chosen budget, and a
    recent window keeps machine drift out.
    """

    def __init__(
        self,
        curve: VerifyCostCurve,
        max_budget: int = MAX_BUDGET,
        window: int = 64,
        rounds: int = 256,
        timed_rounds: int = 128,
    ) -> None:
        self.curve = curve
        self.max_budget = min(max_budget, curve.sizes[-1] - 1)  # never extrapolate the cost curve
        self._surrogates: deque[np.ndarray] = deque(maxlen=window)
        self._rounds: deque[ObservedRound] = deque(maxlen=rounds)
        self._promised: deque[np.ndarray] = deque(maxlen=rounds)
        """Per round of :attr:`_rounds`, the gain per node rank its sequence's drafter promised, 0 past
        the ranks it verified: the growth calibration weighs what rounds realized against what was
        promised for those very rounds (against the recent proposals' mean, a window of other texts
        than the rounds', it read a well-calibrated drafter as overconfident; docs/decisions.md,
        "growth calibrated round by round")."""
        self._timed: dict[bool, deque[tuple[int, float, int]]] = {
            plain: deque(maxlen=timed_rounds) for plain in (True, False)
        }
        """(q, measured / curve, :attr:`_plain_timed` then) of the latest timed plain rounds (q = 1)
        and, apart, tree rounds: a stretch of sequences that drafted every round pushed every plain
        round out of one window, and a plain round fell back to the curve's own point while the trees
        read the machine's slower speed since, so plain decoding looked far cheaper than it ran and
        every later lone request decoded plainly (docs/decisions.md, "a lone round's time outside its
        stages"). A tree round leaves once as many plain rounds were timed after it as the window
        holds: a tree's time says what it costs beside the plain rounds of its day, and trees timed
        in a slow spell of the machine, which made the plan stop drafting, would otherwise outlive
        it for as long as only the rare explorations timed new trees (docs/decisions.md, "tree
        rounds age out by the plain rounds timed after them")."""
        self._plain_timed = 0
        """Plain rounds timed so far."""
        self._mean_gains: np.ndarray | None = None
        """The finished proposals' mean gain per node rank, until one more comes (every sequence that
        has not drafted yet is estimated from it)."""
        self._finished_gains: tuple[np.ndarray, np.ndarray, float] | None = None
        """The finished rounds' per-rank gains, counts and growth calibration, until they change
        (every running sequence's estimate reads them, so they are computed once per change)."""
        self._cost: Callable[[float, float], float] | None = None
        """:meth:`cost`, until timed rounds come."""

    @property
    def has_proposals(self) -> bool:
        """Whether finished sequences taught it any proposal (else it knows nothing of acceptance)."""
        return bool(self._surrogates)

    def observe_proposal(self, surrogate: Sequence[float]) -> None:
        self._surrogates.append(self._padded(surrogate))
        self._mean_gains = None
        self._finished_gains = None

    def _padded(self, surrogate: Sequence[float]) -> np.ndarray:
        """``surrogate`` cut or extended (flat) to budgets 0..max_budget."""
        cut = np.asarray(surrogate[: self.max_budget + 1], dtype=float)
        padded = np.full(self.max_budget + 1, cut[-1])
        padded[: len(cut)] = cut
        return padded

    def observe_rounds(
        self, rounds: Sequence[ObservedRound], promised: Sequence[float] | None = None
    ) -> None:
        """Verified rounds and the gain per node rank (1..max_budget) their drafter promised (None: the
        recent proposals' mean). Only rounds verified alone rescale the curve: a shared forward's
        time is not its tree's. Only rounds that verified a tree teach acceptance: under load most
        rounds verify none, and they would push the few that did out of the record while adding
        nothing to any rank's count."""
        drafted = [r for r in rounds if r.budget > 0]
        if drafted:
            gains = self.promised_gains() if promised is None else np.asarray(promised, dtype=float)
            ranks = np.arange(1, self.max_budget + 1)
            self._rounds.extend(drafted)
            self._promised.extend(gains * (ranks <= r.budget) for r in drafted)
            self._finished_gains = None
        for r in rounds:
            if r.seconds > 0 and r.forward is None:
                q = r.budget + 1
                self._plain_timed += q == 1
                self._timed[q == 1].append((q, r.seconds / self.curve(q, r.context), self._plain_timed))
        trees = self._timed[False]
        while trees and self._plain_timed - trees[0][2] >= trees.maxlen:
            trees.popleft()
        self._cost = None

    def surrogate(self, sequence: GenerationStats | None = None) -> list[float]:
        """Mean surrogate acceptance per budget over ``sequence``'s own proposals when it has any,
        else over the recent finished ones (1.0 everywhere before any)."""
        return [1.0, *(1.0 + np.cumsum(self.promised_gains(sequence))).tolist()]

    def promised_gains(self, sequence: GenerationStats | None = None) -> np.ndarray:
        """Per node rank 1..max_budget, what :meth:`surrogate` adds at it (a rank past a proposal's
        tree adds nothing to that proposal's)."""
        if sequence is not None and sequence.surrogates:
            mean = sequence.surrogate_gains()[: self.max_budget]
            gains = np.zeros(self.max_budget)
            gains[: len(mean)] = mean
            return gains
        if not self._surrogates:
            return np.zeros(self.max_budget)
        if self._mean_gains is None:
            self._mean_gains = np.diff(np.mean(np.asarray(self._surrogates), axis=0))
            self._mean_gains.flags.writeable = False  # shared by every estimate until it changes
        return self._mean_gains

    def cost(self) -> Callable[[float, float], float]:
        """t(q, n): the cached curve rescaled by the recent rounds' own verification times (the same
        function until a finished sequence adds rounds: a lone sequence asks for it every time its
        context grows by a planning step). Until steady plain rounds were timed (:func:`rounds_of`),
        a plain round (q = 1) costs the curve's own point, timed in a run as plain decoding runs: the
        drafting rounds' scale, carried down to it, put a plain round above what plain decoding took
        (their drafter pushes the target's weights out of a CPU's cache), and a plan that read it
        kept drafting, never timing a plain round that would have told it otherwise
        (docs/decisions.md, "plain rounds timed where they run steady")."""
        if self._cost is None:
            sizes, scales, counts = self.cost_scales()
            if not sizes:
                self._cost = self.curve
            else:
                slope, intercept = (
                    np.polyfit(sizes, scales, 1, w=np.sqrt(counts)) if len(sizes) > 1 else (0.0, scales[0])
                )
                low, high = sizes[0], sizes[-1]

                def scaled(q: float | np.ndarray, context: float) -> float | np.ndarray:
                    fitted = intercept + slope * np.clip(q, low, high)
                    scale = fitted if low == 1 else np.where(np.less(q, 2), 1.0, fitted)  # plain: untimed
                    return self.curve(q, context) * (float(scale) if np.ndim(scale) == 0 else scale)

                self._cost = scaled
        return self._cost

    def cost_scales(self) -> tuple[list[int], list[float], list[int]]:
        """Verified sizes with enough timed rounds, their median measured / cached-curve time, and
        how many rounds each."""
        ratios: dict[int, list[float]] = {}
        for q, ratio, _ in [*self._timed[True], *self._timed[False]]:
            ratios.setdefault(q, []).append(ratio)
        sizes = sorted(q for q, seen in ratios.items() if len(seen) >= MIN_TIMED_ROUNDS)
        return sizes, [float(np.median(ratios[q])) for q in sizes], [len(ratios[q]) for q in sizes]

    def rank_gains(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node rank 1..max_budget: summed acceptance gain over the recent rounds that verified
        that rank, and how many did."""
        return _rank_gains(((r.budget, r.accepted) for r in self._rounds), self.max_budget)

    def growth_calibration(self) -> float:
        """Realized / promised gain over the upper half of the ranks at least :data:`PRIOR_ROUNDS`
        rounds verified, both summed over those rounds, at most 1; 1 before that."""
        return self._finished()[2]

    def _finished(self) -> tuple[np.ndarray, np.ndarray, float]:
        """:meth:`rank_gains` and :meth:`growth_calibration`, computed once per change of the record."""
        if self._finished_gains is None:
            if not self._rounds:
                self._finished_gains = (np.zeros(0), np.zeros(0), 1.0)
            else:
                observed, counts = self.rank_gains()
                promised = np.sum(self._promised, axis=0)
                self._finished_gains = (observed, counts, _growth(promised, observed, counts))
        return self._finished_gains

    def expected_tau(self, sequence: GenerationStats | None = None) -> list[float]:
        """Expected acceptance length per budget 0..max_budget (see the class docstring), for the
        running ``sequence`` (its record so far) or, without one, for the recent finished rounds."""
        gains = self.promised_gains(sequence)
        if self._rounds:
            observed, counts, growth = self._finished()
            gains = (observed + PRIOR_ROUNDS * gains * growth) / (counts + PRIOR_ROUNDS)
        if sequence is not None and sequence.rounds:
            own = latest_drafted(sequence, OWN_ROUNDS)
            observed, counts = _rank_gains(
                ((sequence.tree_sizes[i], sequence.accepted_nodes[i]) for i in own), self.max_budget
            )
            gains = (observed + PRIOR_ROUNDS * gains) / (counts + PRIOR_ROUNDS)
        return [1.0, *(1.0 + np.cumsum(gains)).tolist()]


def _rank_gains(
    rounds: Iterable[tuple[int, Sequence[int]]], max_budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`BudgetPlanner.rank_gains` over ``rounds``, each (nodes verified, accepted node indices)
    (counted round by round: a running sequence's estimate reads its latest rounds every few rounds,
    and [rounds, max_budget] matrices cost it several times more)."""
    gains = np.zeros(max_budget + 1)
    reached = np.zeros(max_budget + 1)  # rounds whose top verified rank is each
    for budget, accepted in rounds:
        top = min(budget, max_budget)
        reached[top] += 1
        for i in accepted:  # accepted node indices rise along the path: node r is rank r
            if 0 < i <= top:
                gains[i] += 1.0
    counts = np.cumsum(reached[::-1])[::-1]  # rounds that verified rank r or more
    return gains[1:], counts[1:]


def _growth(promised: np.ndarray, observed: np.ndarray, counts: np.ndarray) -> float:
    """:meth:`BudgetPlanner.growth_calibration` from the per-rank gains promised and realized, each
    summed over the rounds that verified the rank (``counts`` of them)."""
    well = np.flatnonzero(counts >= PRIOR_ROUNDS)  # ranks 1..top: counts fall with the rank
    if not len(well):
        return 1.0
    upper = slice((well[-1] + 1) // 2, well[-1] + 1)
    realized = float(observed[upper].sum())
    predicted = float(promised[upper].sum())
    return min(1.0, realized / predicted) if predicted > 1e-6 else 1.0
