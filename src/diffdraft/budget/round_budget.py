"""Every tree of a round sized together, so speculation never loses to plain decoding under load.

Sequences decoded together share one verification forward, whose time grows with the tokens of all
their trees, and each sequence that drafts pays its drafter's work. A budget that pays for one
sequence alone can lose to plain decoding at batch 8 (docs/decisions.md, "every tree of a round
sized together"). So each round picks every sequence's node budget B_i, 0 included (no drafting:
the sequence verifies its pending token alone, as plain decoding does), to maximize the batch's
expected committed tokens per second:

    sum_i tau_i(B_i) / (t(sum_i (B_i + 1), sequences, context) + d * #{B_i > 0} + c * sequences)

with tau_i a sequence's expected acceptance length per budget (:meth:`BudgetPlanner.expected_tau`
from its own record, its gains scaled by what the rounds plans chose to draft realized of theirs:
:mod:`~diffdraft.budget.chosen_rounds`), t the verification forward (the single-sequence curve
alone, the batch curve shared, both rescaled by the finished sequences' own forwards), d the
drafting, tree and mask time of one drafting sequence and c each sequence's acceptance and commit
(alone also its wall time in no stage: :func:`_outside_seconds`), both learned from finished
sequences: from those decoded alone for a round of one sequence, from those that shared forwards for
a round of several (drafting in a batch costs a sequence another time than drafting alone, and a
planner that carried batch-8 drafting times to a lone sequence stopped it drafting). Before any
lone sequence finished, a lone sequence's d and c come from its own rounds so far
(:class:`OwnRounds`); d is a drafted round's within a run of them, and starting a run costs more once
(:class:`DraftingCost`).

Under load most sequences end at B_i = 0: a drafter forward and its tree do not pay for themselves
once a CPU's forward cost grows with every verified token. A copy does not need the drafter:
:func:`plan_copies` then lets a sequence at B_i = 0 verify the tokens of a free copy (prompt
lookup's, for ``ddtree+pld``) that raise the same rate, each copied token counted at the
probability the drafter expects it kept (docs/decisions.md, as above).
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from diffdraft.budget.aftermath import PlainForwards, aftermath_seconds, plain_forwards
from diffdraft.budget.batch_cost import BatchCostCurve
from diffdraft.budget.chosen_rounds import ChosenRounds
from diffdraft.budget.planner import MIN_TIMED_ROUNDS, BudgetPlanner
from diffdraft.runtime.stats import GenerationStats, TauEstimate
from diffdraft.trees import RoundSequence

COMMIT_STAGES = ("accept", "commit")
"""What every sequence pays per round outside the shared forward."""
NO_DRAFT = [1.0]
"""The expected acceptance of a sequence that cannot draft (one object, so plans can be reused)."""
TREE_SCALE_FLOOR = 0.5
"""The least :meth:`RoundBudgetPlanner.tree_scale` reads, as a share of the plain forwards' scale:
forwards whose trees add little (short copies) measure their extra under the noise of their plain
part, and read as 0 the plan took trees for free (255-node trees for a whole batch, rounds many
times a plain one's; docs/decisions.md, "trees' extra scaled apart from plain forwards")."""


def plan_budgets(
    taus: Sequence[Sequence[float]],
    verify_seconds: Sequence[float],
    draft_seconds: float,
    fixed_seconds: float,
    explore: Sequence[bool],
) -> list[int]:
    """Budgets B_i maximizing ``sum tau_i[B_i] / (verify_seconds[sum (B_i + 1)] + draft_seconds *
    #{B_i > 0} + fixed_seconds)``.

    ``taus[i]`` covers sequence i's candidate budgets 0..len - 1 (``[1.0]``: it cannot draft);
    ``verify_seconds[q]`` is the forward of q tokens in all, nondecreasing in q (a measured curve's
    :func:`running_max`);
    ``explore[i]`` makes sequence i draft (B_i >= 1) whatever it costs, so its record stays fresh.

    First the greedy path: nodes added one at a time, each to the sequence whose next node gains the
    most, the best point on the way kept (for every total it has the most acceptance when gains
    fall with the rank). Then coordinate ascent from there: each step moves the one sequence whose
    best budget, the others held, raises the rate most (a jump, not a unit step: drafting's cost
    comes at B = 1 and pays back over several nodes), until no move does. Both stop looking at
    bigger budgets once even the highest acceptance reachable could not pay for their forward: a
    sequence has hundreds of candidate budgets, and under load a plan that walked them all cost a
    visible share of a round (docs/decisions.md, "plans bounded and stood under load").
    """
    cost = verify_seconds
    lowest = [1 if must and len(tau) > 1 else 0 for tau, must in zip(taus, explore, strict=True)]
    peaks = [max(tau[b:]) for tau, b in zip(taus, lowest, strict=True)]

    def rate(gained, tokens, drafting):
        return gained / (cost[tokens] + draft_seconds * drafting + fixed_seconds)

    budgets = _best_on_greedy_path(taus, lowest, rate)
    gained = sum(tau[b] for tau, b in zip(taus, budgets, strict=True))
    tokens = sum(budgets) + len(budgets)
    drafting = sum(b > 0 for b in budgets)
    best = rate(gained, tokens, drafting)
    while True:
        move = None
        for i, tau in enumerate(taus):
            current = budgets[i]
            others = gained - tau[current]
            rest_tokens = tokens - current
            rest_drafting = drafting - (current > 0)
            reachable = others + peaks[i]
            pick, value = current, best * (1 + 1e-9)
            for option in range(lowest[i], len(tau)):
                drafters = rest_drafting + (option > 0)
                seconds = cost[rest_tokens + option] + draft_seconds * drafters + fixed_seconds
                if reachable <= best * seconds:
                    break  # nor can any bigger budget: its forward costs no less
                candidate = (others + tau[option]) / seconds
                if candidate > value:  # the smallest budget among equals
                    pick, value = option, candidate
            if pick != current:
                best, move = value, (i, pick)
        if move is None:
            return budgets
        i, budget = move
        gained += taus[i][budget] - taus[i][budgets[i]]
        tokens += budget - budgets[i]
        drafting += (budget > 0) - (budgets[i] > 0)
        budgets[i] = budget


def plan_copies(
    taus: Sequence[Sequence[float]],
    budgets: Sequence[int],
    copies: Sequence[Sequence[float] | None],
    verify_seconds: Sequence[float],
    draft_seconds: float,
    fixed_seconds: float,
    copy_seconds: float = 0.0,
) -> list[int]:
    """How many tokens of each offered free copy to verify, the budgets of :func:`plan_budgets`
    held: ``copies[i]`` is the expected acceptance length of sequence i's copy per copied length
    0..L (None: none offered), taken only where the sequence drafts no tree (B_i = 0), never longer
    than ``taus[i]`` reaches (the cost is not extrapolated). A copy costs no drafting, only its
    tokens' share of the forward and ``copy_seconds`` per sequence that takes one (its chain and
    mask): its tokens join most likely first, along the same greedy path as the budgets', and the
    point of that path with the best rate is kept. In plain Python: a batch's round asks this of
    a few short curves, where numpy's overhead cost more than the work. ``verify_seconds`` as
    :func:`plan_budgets` takes it."""
    cost = verify_seconds
    offered = [copy is not None and budget == 0 for budget, copy in zip(budgets, copies, strict=True)]
    curves = [
        [float(x) for x in (copy[: len(tau)] if offer else tau[: budget + 1])]
        for tau, budget, copy, offer in zip(taus, budgets, copies, offered, strict=True)
    ]
    drafting = sum(budget > 0 for budget in budgets)

    def rate(gained, tokens, starts):  # the path's "starts" counts the drafting sequences, then copies
        copying = starts - drafting
        return gained / (cost[tokens] + draft_seconds * drafting + copy_seconds * copying + fixed_seconds)

    lowest = [0 if offer else budget for budget, offer in zip(budgets, offered, strict=True)]
    lengths = _best_on_greedy_path(curves, lowest, rate)
    return [length if offer else 0 for length, offer in zip(lengths, offered, strict=True)]


def running_max(seconds: Sequence[float]) -> list[float]:
    """A measured forward-time curve made nondecreasing, as :func:`plan_budgets` and :func:`plan_copies`
    take it (a forward of more tokens never costs less; measurements can say otherwise by noise)."""
    return np.maximum.accumulate(np.asarray(seconds, dtype=float)).tolist()


def _best_on_greedy_path(
    curves: Sequence[Sequence[float]], lowest: list[int], rate: Callable[[float, int, int], float]
) -> list[int]:
    """The best point of :func:`plan_budgets`' greedy path: every sequence's next nodes ordered by gain
    (by their running minimum, so a sequence's nodes keep their order; equals in sequence order),
    then the rate after each, ``rate(gained, tokens, starts)`` (starts: sequences past budget 0); the
    fewest nodes among equal rates. ``rate`` must rise with ``gained`` and never with ``tokens`` or
    ``starts``: the path ends once not even every sequence's highest acceptance at its current tokens
    would beat the best point (under load, a few nodes into thousands)."""
    gained = sum(tau[b] for tau, b in zip(curves, lowest, strict=True))
    tokens = sum(lowest) + len(lowest)
    started = sum(b > 0 for b in lowest)
    # a hair above every sequence's highest acceptance: the path's sums round, and must not end it
    # before a point the whole walk would keep
    reachable = sum(max(tau[b:]) for tau, b in zip(curves, lowest, strict=True)) * (1 + 1e-9)
    best, steps, total = rate(gained, tokens, started), 0, 0.0
    ranks = list(lowest)
    keys = [float("inf")] * len(curves)
    upcoming = []  # (-key, sequence) of every sequence's next node: a heap, equals in sequence order
    for i, tau in enumerate(curves):
        if ranks[i] < len(tau) - 1:
            keys[i] = tau[ranks[i] + 1] - tau[ranks[i]]
            upcoming.append((-keys[i], i))
    heapq.heapify(upcoming)
    owners = []
    while upcoming and rate(reachable, tokens + 1, started) > best:
        _, i = heapq.heappop(upcoming)
        tau, rank = curves[i], ranks[i]
        total += tau[rank + 1] - tau[rank]
        tokens += 1
        started += rank == 0
        ranks[i] = rank + 1
        owners.append(i)
        value = rate(gained + total, tokens, started)
        if value > best:
            best, steps = value, len(owners)
        if rank + 1 < len(tau) - 1:
            keys[i] = min(keys[i], tau[rank + 2] - tau[rank + 1])
            heapq.heappush(upcoming, (-keys[i], i))
    budgets = list(lowest)
    for i in owners[:steps]:
        budgets[i] += 1
    return budgets


class RoundBudgetPlanner:
    """Plans each round's budgets (:func:`plan_budgets`) from a :class:`BudgetPlanner`'s acceptance
    model and cost curve, a batch cost curve for shared forwards, and the stage times of finished
    sequences.

    A sequence drafts on its first round when it runs alone, or while no finished sequence drafted
    (nothing else could guide it; in a batch the others' record stands in), and whenever it has not
    drafted for ``explore_every`` rounds times the sequences in the round (``explore_alone`` rounds
    when it runs alone): plain decoding teaches nothing about acceptance, and what pays changes along
    a text and as sequences join and leave, but each exploration costs a drafting sequence's time, so
    a batch explores about once per ``explore_every`` rounds whatever its size (at batch 8, every
    sequence exploring at that interval cost the batch a visible share of its throughput). Each
    exploration after which the sequence still did not draft of its own accord doubles its
    interval, up to ``2 ** explore_backoff`` times, and its next voluntary drafting round resets it:
    where drafting does not pay (under load on a small CPU, and alone on some), each forced tree
    costs more than it gains, alone also the plain rounds after it (the drafter pushed the target's
    weights out of the cache, so exploring every 8 rounds lost a lone sequence time where drafting
    lost). Alone the interval starts shorter: a sequence that stopped drafting on a hard stretch of
    text must notice soon that drafting pays again (docs/decisions.md, "every tree of a round sized
    together" and "plain rounds timed where they run steady").

    A sequence's acceptance estimate is refreshed after ``refresh`` drafted rounds, after any drafted
    round once it stopped drafting (an exploration is news), with each new surrogate and when a
    finished sequence taught the planner, not every round (it reads the sequence's latest rounds); a
    round whose inputs did not change but for contexts within ``context_step`` tokens reuses the last
    plan (at batch 8 planning is a noticeable share of a round; docs/decisions.md, "every tree of a
    round sized together"), and a plan that
    left a batch all plain (no tree, no copy) stands ``plain_rounds`` rounds before it is made again,
    while several sequences share the round, whichever join or leave, and twice as long each time it
    is made plain again, up to ``2 ** plain_backoff`` times: under load nearly every round plans that,
    and a few rounds late is nothing to an exploration due every ``explore_every`` rounds per sequence.
    A plan that drafts starts the stands over. One that takes a copy is made again the next round
    (copies come in runs), and a lone sequence is planned every round; neither changes the stands
    (under load copies are frequent, and clients that send requests of one length leave a sequence
    alone for a round every request: restarting at ``plain_rounds`` after either made a plan every
    dozen rounds at 4 clients, each a visible share of a round; docs/decisions.md, "plans bounded and
    stood under load").

    A sequence left alone right after sharing rounds (the others ended) decodes that round plainly:
    under load a waiting request joins it within a round or two, and its first tree would pay for
    taking in its whole context, which the plan does not count; still alone a round later, it is
    planned as any lone sequence (docs/decisions.md, "plans bounded and stood under load").
    """

    def __init__(
        self,
        planner: BudgetPlanner,
        batch_cost: BatchCostCurve | Callable[[], BatchCostCurve] | None = None,
        explore_every: int = 32,
        explore_alone: int = 8,
        refresh: int = 8,
        window: int = 64,
        timed_rounds: int = 128,
        context_step: int = 64,
        plain_rounds: int = 8,
        explore_backoff: int = 2,
        plain_backoff: int = 3,
        cost_refresh: int = 4,
    ) -> None:
        """``batch_cost`` may be a loader, called on the first round shared by several sequences:
        measuring it takes a while, and a process that never batches never pays for it."""
        self.planner = planner
        self._batch_cost = batch_cost
        self.explore_every = explore_every
        self.explore_alone = explore_alone
        self.explore_backoff = explore_backoff
        self.refresh = refresh
        self._draft_seconds = StageSeconds(window)
        """Seconds per drafted round within a run of them, of finished sequences."""
        self._entry_seconds = StageSeconds(window)
        """Seconds per run of drafted rounds that entering it cost beyond its rounds' own, of finished
        sequences (:class:`DraftingCost`)."""
        self._commit_seconds = StageSeconds(window)
        self._copy_seconds = StageSeconds(window)
        """Seconds per free copy of finished sequences: taking it, building its chain and mask, and its
        share of the plan (:attr:`~diffdraft.runtime.stats.GenerationStats.copy_plan_seconds`)."""
        self._batch_forwards: dict[bool, dict[tuple[tuple[int, int, int], float], TimedForward]] = {
            speculative: {} for speculative in (False, True)
        }
        """The latest ``timed_rounds`` plain and, apart, speculative shared forwards of finished
        sequences, by forward (shape and seconds): every sequence of a round recorded it, and it
        counts once. Kept apart because under load plain forwards would push every tree's out of
        one window, and a plan that forgot what trees cost drafted again where they did not pay."""
        self.timed_rounds = timed_rounds
        self._scales: dict[tuple[bool, int], float] = {}
        """:meth:`batch_scale` (False) and :meth:`tree_scale` (True) by sequences, until new forwards are
        kept: every cost curve a plan reads asks both, and each reads up to ``timed_rounds`` forwards
        (under a profiler a cost curve made anew spent nearly all its time there; docs/decisions.md,
        "plans bounded and stood under load")."""
        self.context_step = context_step
        self.plain_rounds = plain_rounds
        self.plain_backoff = plain_backoff
        self._plain: int | None = None
        """Rounds the last plan stood, when it left a batch all plain (budget 0, no copy)."""
        self._stand = plain_rounds
        """Rounds a plan that leaves a batch all plain stands."""
        self._learned = 0
        """Finished sequences observed."""
        self.cost_refresh = cost_refresh
        self._costs: dict[tuple, tuple[list[float], float, float]] = {}
        """Each round shape's costs (:meth:`round_costs`) since they were last refreshed: after each
        of the first ``cost_refresh`` finished sequences (costs start from nothing), then after every
        ``cost_refresh``-th. One sequence moves windows of many rounds little, and reading them anew
        for every finished sequence cost a visible share of the plans under load (docs/decisions.md,
        "plans bounded and stood under load")."""
        self._forward_costs: dict[tuple[int, int, int], list[float]] = {}
        """The forward part of :attr:`_costs` by shape alone, refreshed with it: every variant of a
        shape (a lone round that would start a run of drafted rounds or go on with one) reads the
        same forward. Each made its own when first asked, and a lone sequence whose two variants came
        from records a few sequences apart alternated plain and drafted rounds on the difference."""
        self.chosen = {alone: ChosenRounds() for alone in (True, False)}
        """How much of the gains it expected the rounds it chose to draft realized, of lone sequences
        and apart of shared rounds: scales every estimate (:meth:`expected_tau`). Kept apart as the
        stage times are: a server's first load at 8 clients left its factor on every lone request
        after it for as long as 64 sequences (docs/decisions.md, as above)."""
        self._taught = 0
        """Finished sequences that taught acceptance (drafted a tree or proposed a surrogate): a new
        one makes every estimate stale. Under load most finished sequences drafted nothing, and
        re-estimating every running sequence after each cost a visible share of the plans."""
        self._last_plan: tuple[list, tuple, list[int]] | None = None
        """The last round's estimates and costs, other inputs and budgets."""
        self._round: tuple[list[list[float]], float, OwnRounds | None, bool] = ([], 0.0, None, True)
        """The round :meth:`plan` planned last: its estimates, mean context, a lone sequence's own
        costs and whether drafting would start a run (its copies' too)."""
        self._own: tuple[GenerationStats | None, int, OwnRounds | None] = (None, -1, None)
        """A lone running sequence's stats, the round its own costs were last read and those costs."""
        self._last_copies: tuple[list, tuple, list[int]] | None = None
        """The last copy plan's estimates, costs and copies (the same objects while they hold: a
        copier's ceiling does), its budgets and copy seconds, and its lengths."""

    def prepare_batches(self) -> None:
        """Measure (or read from the cache) the batch curve now, so a server does not stall its first
        shared round on it."""
        _ = self.batch_cost

    @property
    def batch_cost(self) -> BatchCostCurve | None:
        if callable(self._batch_cost) and not isinstance(self._batch_cost, BatchCostCurve):
            self._batch_cost = self._batch_cost()
        return self._batch_cost

    def draft_seconds(self, alone: bool = True) -> float:
        """Seconds one drafting sequence adds to a round of one sequence (``alone``) or of several,
        within a run of drafted rounds, as the finished sequences that ran so measured it (0 before
        any did; shared rounds read the lone ones' before theirs, not the other way: a shared round's
        drafting pays its share of a batch's plan): its drafter's forward, its tree and its share of
        the plan (:class:`DraftingCost`)."""
        return self._draft_seconds.median(alone)

    def entry_seconds(self, alone: bool = True) -> float:
        """Seconds a run of drafted rounds costs beyond its rounds' :meth:`draft_seconds` (as that):
        its drafter's catch-up and the aftermath (:class:`DraftingCost`)."""
        return self._entry_seconds.median(alone)

    def _round_draft_seconds(self, alone: bool, entering: bool, own: float | None) -> float:
        """What the plan charges a drafting sequence: a drafted round's own cost (``own``: a lone
        sequence's, standing in for the record while no lone sequence finished) and, when it starts
        a run (``entering``), the run's entry cost, spread over ``refresh`` rounds alone (a run lasts
        while its estimate holds, refreshed that often) and charged whole in a batch (under load a
        sequence drafts now and then, each drafted round a run of its own)."""
        draft = self.draft_seconds(alone) if own is None else own
        if not entering:
            return draft
        entry = max(0.0, self.entry_seconds(alone))  # a median below 0 is noise: entering costs no less
        return draft + entry / (self.refresh if alone else 1)

    def _own_rounds(self, stats: GenerationStats) -> OwnRounds | None:
        """A lone running sequence's own costs (:class:`OwnRounds`) where no lone sequence finished
        yet to give them, read anew every ``refresh`` rounds; None once the records hold both."""
        draft_known, commit_known = not self._draft_seconds.none(True), not self._commit_seconds.none(True)
        if draft_known and commit_known:
            return None
        last, read, own = self._own
        rounds = len(stats.tree_sizes)
        if last is not stats or rounds - read >= self.refresh:
            own = OwnRounds.of(stats, draft=not draft_known, outside=not commit_known)
            self._own = (stats, rounds, own)
        return own

    def copy_seconds(self, alone: bool = True) -> float:
        """Seconds a free copy adds to a round besides its tokens' share of the forward (as
        :meth:`draft_seconds`; 0 before any copy was measured, so copies get tried)."""
        return self._copy_seconds.median(alone)

    def commit_seconds(self, alone: bool = True) -> float:
        """Seconds each sequence adds to a round outside the forward and drafting (as
        :meth:`draft_seconds`)."""
        return self._commit_seconds.median(alone)

    def observe_generation(self, stats: GenerationStats) -> None:
        """Learn a finished sequence's stage times and its shared forwards' times."""
        self._learned += 1
        if self._learned <= self.cost_refresh or self._learned % self.cost_refresh == 0:
            self._costs.clear()
            self._forward_costs.clear()
        alone = _ran_alone(stats)
        plain = plain_forwards(stats)  # read by the drafting cost and the shared forwards' window
        self.chosen[alone].observe(stats)  # reaches the estimates as _taught's change does (it drafted)
        self._taught += bool(any(stats.drafter_sizes()) or stats.surrogates)
        cost = DraftingCost.of(stats, plain)
        if cost is not None:
            self._draft_seconds.add(alone, cost.round)
            self._entry_seconds.add(alone, cost.entry)
        if stats.copy_rounds:
            seconds = stats.copy_seconds + stats.copy_plan_seconds
            self._copy_seconds.add(alone, seconds / len(stats.copy_rounds))
        if stats.rounds:
            self._commit_seconds.add(alone, _outside_seconds(stats, alone) / stats.rounds)
        self._keep_forwards(stats, plain.steady)

    def _keep_forwards(self, stats: GenerationStats, steady: list[bool]) -> None:
        """Keep a finished sequence's shared forwards that no sequence that shared them kept yet,
        each beside the batch curve's time for it (looked up together), in their windows: a plain one
        only where it ran ``steady`` (:attr:`~diffdraft.budget.aftermath.PlainForwards.steady`), as
        :func:`~diffdraft.budget.planner.rounds_of` times a lone sequence's."""
        new = {}
        for forward, seconds, timed in zip(stats.verify_forwards, stats.verify_seconds, steady, strict=True):
            key = (tuple(forward), seconds)
            wide = forward[1] > forward[0]
            if forward[0] > 1 and seconds > 0 and (wide or timed) and key not in self._batch_forwards[wide]:
                new[key] = key[0]
        if not new or self.batch_cost is None:  # (the curve is loaded once a forward was shared)
            return
        sequences, tokens, context = np.asarray(list(new.values()), dtype=float).T
        curves = self.batch_cost(tokens, sequences, context).tolist()
        plains = self.batch_cost(sequences, sequences, context).tolist()
        for (key, (sequences, tokens, _)), curve, plain in zip(new.items(), curves, plains, strict=True):
            self._batch_forwards[tokens > sequences][key] = TimedForward(sequences, key[1], curve, plain)
        for kept in self._batch_forwards.values():
            while len(kept) > self.timed_rounds:
                del kept[next(iter(kept))]  # the oldest: dicts keep order
        self._scales.clear()

    def verify_seconds(self, tokens: np.ndarray, sequences: int, context: float) -> np.ndarray:
        """The forward's seconds for each total of ``tokens`` shared by ``sequences`` over ``context``
        cached tokens each: the calibrated single-sequence curve alone (and without a batch curve,
        over all the tokens at once), else the batch curve, its plain part (one token a sequence) and
        what the trees add to it each scaled by what the finished sequences' forwards took against it
        (:meth:`batch_scale`, :meth:`tree_scale`)."""
        if sequences == 1 or self.batch_cost is None:
            return np.asarray(self.planner.cost()(tokens, context))
        curve = np.asarray(self.batch_cost(tokens, sequences, context))
        plain = self.batch_cost(sequences, sequences, context)
        return self.batch_scale(sequences) * plain + self.tree_scale(sequences) * (curve - plain)

    def batch_scale(self, sequences: int) -> float:
        """Median measured / curve time of the plain forwards (one token a sequence) of finished
        sequences, shared by ``sequences`` sequences: of any number while too few of that one
        finished, 1 while too few plain ones did (the curve's plain points are timed in a run, as
        plain decoding runs). Not the trees' forwards: they run slower than the curve (their drafter
        pushes the target's weights out of a CPU's cache), and a plain round read at their scale
        kept a plan drafting that never timed a plain one (docs/decisions.md, "plain rounds timed
        where they run steady")."""
        return self._scale(False, sequences)

    def _batch_scale(self, sequences: int) -> float:
        plain = list(self._batch_forwards[False].values())
        for kept in ([f for f in plain if f.sequences == sequences], plain):
            if len(kept) >= MIN_TIMED_ROUNDS:
                return float(np.median([f.seconds / f.curve for f in kept]))
        return 1.0

    def tree_scale(self, sequences: int) -> float:
        """What finished forwards shared by ``sequences`` sequences with trees took past their plain
        part (:meth:`batch_scale` of the curve's), summed, over what the curve puts there, summed (of
        any number of sequences while too few of that one finished; the plain scale before that), at
        least :data:`TREE_SCALE_FLOOR` of the plain scale.
        A machine's forward does not grow with the tokens as it did when the curve was measured:
        scaled as a whole to fit the plain forwards, which most are under load, the curve put a
        tree's extra well under what it took, and the plan drafted where it did not pay
        (docs/decisions.md, "trees' extra scaled apart from plain forwards")."""
        return self._scale(True, sequences)

    def _scale(self, trees: bool, sequences: int) -> float:
        """:meth:`tree_scale` (``trees``) or :meth:`batch_scale`, computed once until new forwards
        are kept (:attr:`_scales`)."""
        key = (trees, sequences)
        if key not in self._scales:
            self._scales[key] = (self._tree_scale if trees else self._batch_scale)(sequences)
        return self._scales[key]

    def _tree_scale(self, sequences: int) -> float:
        forwards = list(self._batch_forwards[True].values())
        for kept in ([f for f in forwards if f.sequences == sequences], forwards):
            extra = sum(f.curve - f.plain for f in kept)
            if len(kept) >= MIN_TIMED_ROUNDS and extra > 0:
                plain = sum(self.batch_scale(f.sequences) * f.plain for f in kept)
                floor = TREE_SCALE_FLOOR * self.batch_scale(sequences)
                return max(floor, (sum(f.seconds for f in kept) - plain) / extra)
        return self.batch_scale(sequences)

    def plain_stands(self, sequences: int) -> bool:
        """Whether the last plan left a batch all plain, with no copy, fewer rounds ago than it stands
        (``plain_rounds``, doubled each time it is made plain again), and ``sequences`` (several)
        share this round: it then stands this round too, counted as one more, whichever sequences
        joined or left meanwhile (under load one does every few rounds, and a plan made anew for each
        cost a visible share of the rounds; docs/decisions.md, "plans bounded and stood under
        load")."""
        if self._plain is None or self._plain >= self._stand or sequences < 2:
            return False
        self._plain += 1
        return True

    def plain_settled(self) -> bool:
        """Whether the plans have left shared rounds plain so long that a plain plan stands at its
        longest (no plan gave a tree since): then a gap in the drafter's context, which costs the
        next few drafted rounds some acceptance, costs less than tapping every round for it. A
        shorter stand keeps the taps: batches that draft now and then would draft after gaps."""
        return self._stand == self.plain_rounds << self.plain_backoff

    def plan(self, sequences: Sequence[RoundSequence]) -> list[int]:
        """Each sequence's node budget this round (0: it verifies its pending token alone), when
        :meth:`plain_stands` said no."""
        shared = len(sequences) > 1
        if shared and self._plain is not None:  # a plain plan stood to its end
            self._stand = min(2 * self._stand, self.plain_rounds << self.plain_backoff)
        budgets, explore = self._plan(sequences)
        _record_round(sequences, budgets, explore)
        if any(budgets):
            self._stand = self.plain_rounds
        self._settle(shared and not any(budgets))  # alone, a sequence must notice soon
        return budgets

    def _settle(self, plain: bool) -> None:
        """Let the plan being made stand when it leaves its batch ``plain`` (asked again once its
        copies are known: the round's last answer counts)."""
        self._plain = 0 if plain else None

    def _plan(self, sequences: Sequence[RoundSequence]) -> tuple[list[int], list[bool]]:
        """(each sequence's budget, whether it must draft to explore)."""
        alone = len(sequences) == 1
        drafts = [s.can_draft and not (alone and _shared_last(s.stats)) for s in sequences]
        taus = [
            self.expected_tau(s.stats, alone) if d else NO_DRAFT
            for s, d in zip(sequences, drafts, strict=True)
        ]
        explore = [
            d and self._must_explore(s.stats, len(sequences)) for s, d in zip(sequences, drafts, strict=True)
        ]
        context = sum(s.context for s in sequences) / len(sequences)  # numpy's mean costs more, every round
        own = self._own_rounds(sequences[0].stats) if alone else None
        entering = not (alone and sequences[0].stats.drafted_last_round())
        self._round = (taus, context, own, entering)
        costs = self.round_costs(taus, context, own, entering)
        objects = [*taus, costs]  # compared by identity: the same objects while they hold
        inputs = (explore, int(context) // self.context_step)
        if self._last_plan is not None:
            last_objects, last_inputs, budgets = self._last_plan
            if _identical(last_objects, objects) and last_inputs == inputs:
                return list(budgets), explore
        budgets = plan_budgets(taus, *costs, explore)
        self._last_plan = (objects, inputs, budgets)  # holds them, so `is` cannot see a reused id
        return list(budgets), explore

    def copy_lengths(self, budgets: Sequence[int], copies: Sequence[Sequence[float] | None]) -> list[int]:
        """How many tokens of each sequence's free copy to verify in the round :meth:`plan` just
        planned, its ``budgets`` held (:func:`plan_copies`, from the estimates the plan read;
        ``copies``: each copy's expected acceptance length per copied length, None where none is
        offered). Copies that are the very objects of the last call, all else alike, get its lengths
        (the copiers' ceilings, asked every round). The round's last answer decides whether a plan
        that left a batch plain stands (:meth:`plain_stands`): one that found no copy worth taking."""
        taus, context, own, entering = self._round
        if any(copies):
            costs = self.round_costs(taus, context, own, entering)
            objects = [*taus, costs, *copies]  # compared by identity: the same objects while they hold
            inputs = (list(budgets), self.copy_seconds(len(taus) == 1))
            last = self._last_copies
            if last is None or not (_identical(last[0], objects) and last[1] == inputs):
                last = (objects, inputs, plan_copies(taus, budgets, copies, *costs, inputs[1]))
                self._last_copies = last  # holds them, so `is` sees no reused id
            lengths = list(last[2])
        else:
            lengths = [0] * len(copies)
        self._settle(len(taus) > 1 and not any(budgets) and not any(lengths))
        return lengths

    def round_costs(
        self, taus: list[list[float]], context: float, own: OwnRounds | None = None, entering: bool = False
    ) -> tuple[list[float], float, float]:
        """(forward seconds per total of tokens up to as many as the longest of the ``taus`` covers
        times the sequences, made nondecreasing once here rather than in every plan, seconds one
        drafting sequence adds, seconds the round adds outside both) for a round of ``len(taus)``
        sequences; the same object until they are refreshed (:attr:`_costs`), for contexts within
        ``context_step`` of each other (as a plan is), whichever sequences cannot draft (under load
        one ends every few rounds, and each such round missed a cache keyed by the tokens covered).
        ``own``: a lone sequence's own costs, standing in for the finished lone sequences' records
        while they are empty (:meth:`_own_rounds`); ``entering``: a drafting sequence would start a
        run of drafted rounds (:meth:`_round_draft_seconds`)."""
        shape = (len(taus), max(len(tau) for tau in taus), int(context) // self.context_step)
        key = (*shape, own, entering)
        costs = self._costs.get(key)
        if costs is None:
            for stale in [k for k in self._costs if k[3] not in (None, own)]:
                del self._costs[stale]  # costs of the lone sequence's earlier readings: unread now
            verify = self._forward_costs.get(shape)
            if verify is None:
                tokens = np.arange(shape[0] * shape[1] + 1)
                verify = running_max(self.verify_seconds(tokens, len(taus), context))
                self._forward_costs[shape] = verify
            alone = len(taus) == 1
            own = own or OwnRounds(None, None)
            draft = self._round_draft_seconds(alone, entering, own.draft)
            commit = self.commit_seconds(alone) if own.outside is None else own.outside
            costs = (verify, draft, commit * len(taus))
            self._costs[key] = costs
        return costs

    def expected_tau(self, stats: GenerationStats, alone: bool = True) -> list[float]:
        """:meth:`BudgetPlanner.expected_tau` of the sequence, its gains scaled by the share the
        rounds the plans chose to draft realized (:attr:`chosen`, of lone sequences when it runs
        ``alone``, else of shared rounds), re-estimated when stale: when it moved between running
        alone and sharing rounds, after
        ``refresh`` drafted rounds (a round at budget 0 adds nothing to its record), a new surrogate or
        a newly finished sequence that drafted, or after any drafted round once it skipped drafting.
        The same list object while fresh (:meth:`plan` compares by identity)."""
        estimate = stats.tau_estimate
        fresh = (
            estimate is not None
            and estimate.surrogates == len(stats.surrogates)
            and estimate.taught == self._taught
            and estimate.alone == alone
        )
        if fresh:
            if estimate.checked < len(stats.tree_sizes):
                estimate.count(stats.drafter_sizes(estimate.checked))
            fresh = estimate.drafted < (1 if estimate.skipped else self.refresh)
        if not fresh:
            start = len(stats.tree_sizes)
            estimated = self.planner.expected_tau(stats)
            taus = self.chosen[alone].calibrated(estimated)
            checked = max(0, start - 1)
            estimate = TauEstimate(
                taus, start, len(stats.surrogates), self._taught, checked, estimated, alone
            )
            stats.tau_estimate = estimate
        return estimate.taus

    def _must_explore(self, stats: GenerationStats, sequences: int) -> bool:
        if not stats.surrogates:
            return sequences == 1 or not self.planner.has_proposals
        interval = self.explore_alone if sequences == 1 else self.explore_every * sequences
        interval <<= min(stats.fruitless_explorations, self.explore_backoff)
        rounds = len(stats.tree_sizes)
        return rounds >= interval and not any(stats.drafter_sizes(rounds - interval))


@dataclass(frozen=True)
class TimedForward:
    """A finished shared forward beside what the batch curve puts there."""

    sequences: int
    seconds: float
    """What it took."""
    curve: float
    """The curve's seconds for its shape."""
    plain: float
    """The curve's seconds for as many sequences with one token each."""


@dataclass(frozen=True)
class DraftingCost:
    """What a sequence's drafting cost beyond its verification forwards, in a run of drafted rounds
    and to enter one.

    A drafted round right after one the drafter built costs its drafter's forward over the few tokens
    the last round committed, its tree and its share of the plan (:attr:`round`). Starting a run can
    cost more, once: the drafter takes in every token since it last drafted, and the plain rounds
    after a run go slower while the target's weights come back into a CPU's cache
    (:func:`~diffdraft.budget.aftermath.aftermath_seconds`) (:attr:`entry`). Spread over every drafted
    round, as they were, both made drafting dearest where it was rarest, and a lone request that
    stopped drafting never started again (docs/decisions.md, "a run of drafted rounds pays its entry
    once")."""

    round: float
    """Seconds per drafted round within a run."""
    entry: float
    """Seconds per run beyond its rounds' :attr:`round`: the drafter's catch-up (over the runs after
    the first, which took the prompt in: a one-off) and, for a finished sequence, the aftermath."""

    @classmethod
    def of(cls, stats: GenerationStats, plain: PlainForwards | None = None) -> DraftingCost | None:
        """``stats``'s, None before it drafted a round past its first (which took the prompt in: a
        one-off); where every drafted round began a run, each costs what they took. ``plain``: its
        :func:`~diffdraft.budget.aftermath.plain_forwards` once it finished (the aftermath of a
        running sequence's drafting is still to come)."""
        runs = stats.catch_up_draft_seconds
        drafted = sum(size > 0 for size in stats.drafter_sizes())
        within = drafted - len(runs)
        if within > 0:
            forward = (stats.timings["draft"] - sum(runs)) / within
            catch_ups = [seconds - forward for seconds in runs[1:]]
        elif len(runs) > 1:  # every drafted round began a run (in a batch, most): a round costs that
            forward, catch_ups = statistics.fmean(runs[1:]), []
        else:
            return None
        building = (stats.draft_build_seconds + stats.draft_plan_seconds) / drafted
        entry = statistics.fmean(catch_ups) if catch_ups else 0.0
        if plain is not None:
            entry += aftermath_seconds(stats, plain) / max(1, len(runs))
        return cls(forward + building, entry)


@dataclass(frozen=True)
class OwnRounds:
    """A lone running sequence's own costs per round so far, standing in for the finished lone
    sequences' records while they are empty: the first lone request of a process, or the first after
    a spell of batches (a lone round never reads a batch's). Without them such a request planned as
    if drafting cost nothing (it drafted all through where plain decoding was faster) and as if a
    round cost no time outside its stages (after a load at 8 clients, the first lone request on a
    server drafted little where a fixed budget paid: docs/decisions.md, "a lone round's time
    outside its stages"). Rounded, so the costs they key stay cached while they hold."""

    draft: float | None
    """Seconds a drafted round within a run (:attr:`DraftingCost.round`); None before it drafted a
    round past its first, or where the record has it."""
    outside: float | None
    """Seconds a round outside the forward and drafting (:func:`_outside_seconds`, its wall time so
    far); None before its first round, where the record has it, where its start is unknown (0: stats
    made by hand), or once it shared a round (its wall time then holds the others' stages)."""

    @classmethod
    def of(cls, stats: GenerationStats, draft: bool, outside: bool) -> OwnRounds:
        """``stats``'s costs, ``draft`` and ``outside`` each read only where asked for."""
        cost = DraftingCost.of(stats) if draft else None
        seconds = None
        if outside and stats.started and stats.rounds and _ran_alone(stats):
            wall = time.perf_counter() - stats.started
            seconds = round(_outside_seconds(stats, True, wall) / stats.rounds, 4)
        return cls(None if cost is None else round(cost.round, 4), seconds)


def _outside_seconds(stats: GenerationStats, alone: bool, wall: float | None = None) -> float:
    """What a finished sequence's rounds took outside the forward and drafting: its accept and commit
    stages, and alone also its wall time in no stage (the loop around the stages: the plan, stop
    checks, handing tokens to a server's stream). Every round pays that whatever it verifies, and a
    plan that left it out weighed a drafted round's gain against too small a round: in a server,
    where that time is a good share of a round, lone requests stayed plain where a fixed budget ran
    well faster (docs/decisions.md, "a lone round's time outside its stages"). In a batch a
    sequence's wall time is the whole batch's, so only its stages count. ``wall``: a running
    sequence's wall time so far (else :attr:`~diffdraft.runtime.stats.GenerationStats.total_seconds`)."""
    stages = sum(stats.timings[s] for s in COMMIT_STAGES)
    if not alone:
        return stages
    wall = stats.total_seconds if wall is None else wall
    return stages + max(0.0, wall - sum(stats.timings.values()))


def _record_round(sequences: Sequence[RoundSequence], budgets: list[int], explore: list[bool]) -> None:
    """Count a round's explorations in each sequence's stats; a drafting round the plan chose freely
    clears the count and is recorded, with the estimate it was chosen on before calibration
    (:attr:`~diffdraft.runtime.stats.GenerationStats.chosen_rounds`)."""
    for sequence, budget, forced in zip(sequences, budgets, explore, strict=True):
        stats = sequence.stats
        if budget > 0:
            stats.fruitless_explorations = stats.fruitless_explorations + 1 if forced else 0
            if not forced:  # the plan read the sequence's estimate to give it a tree: it is current
                stats.chosen_rounds.append((len(stats.tree_sizes), stats.tau_estimate.estimated))


def _ran_alone(stats: GenerationStats) -> bool:
    """Whether every round of the sequence verified in a forward of its own."""
    return all(forward[0] == 1 for forward in stats.verify_forwards)


def _shared_last(stats: GenerationStats) -> bool:
    """Whether the sequence's last round shared its forward with other sequences."""
    return bool(stats.verify_forwards) and stats.verify_forwards[-1][0] > 1


def _identical(these: Sequence, those: Sequence) -> bool:
    """Whether both hold the very same objects in the same order."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those, strict=True))


class StageSeconds:
    """A stage's seconds per round of the latest ``window`` finished sequences, kept apart by whether
    they ran alone, and their medians. Not the mean: a few sequences that ran through a stall of the
    machine would move it for as long as they stay in the window (``window`` sequences: a minute of
    lone requests), and a lone sequence that read drafting dearer so drafted far less
    (docs/decisions.md, "stage times by their median"). Each median is
    taken once per new entry, not each time a plan asks (every round that offers a copy)."""

    def __init__(self, window: int) -> None:
        self._seconds: dict[bool, deque[float]] = {alone: deque(maxlen=window) for alone in (True, False)}
        self._medians: dict[bool, float] = {}

    def add(self, alone: bool, seconds: float) -> None:
        self._seconds[alone].append(seconds)
        self._medians.clear()

    def none(self, alone: bool) -> bool:
        """Whether no sequence that ran ``alone`` (or not) added a time yet."""
        return not self._seconds[alone]

    def median(self, alone: bool) -> float:
        """The median of the record of sequences that ran ``alone`` (or not); for shared rounds, the
        lone record's while theirs is empty; else 0. A lone round never reads the shared record: a
        shared round's stage pays its share of a batch's plan, and read alone it kept lone requests
        from taking any copy (docs/decisions.md, "a run of drafted rounds pays its entry once")."""
        median = self._medians.get(alone)
        if median is None:
            record = self._seconds[alone] or (self._seconds[True] if not alone else ())
            median = self._medians[alone] = statistics.median(record) if record else 0.0
        return median
