"""The speculative loop: draft, build a tree, verify it in one target forward, keep what is accepted.

One loop serves every method; drafters, tree builders and verifiers are plugged in. Plain
autoregressive decoding is the same loop with no drafter (every tree is just the root).

A round is split around its target forward (:class:`SequenceRun`: ``draft`` before, ``commit``
after), so :class:`SpeculativeEngine` runs one sequence's rounds and
:class:`~diffdraft.decoding.batching.BatchEngine` verifies several sequences' trees in one forward with the
same per-sequence code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from diffdraft.decoding.fit_check import FitCheck
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.decoding.verify import accept
from diffdraft.drafters.base import (
    CopyingDrafter,
    CopyOffer,
    Drafter,
    Proposal,
    drafts_across_gaps,
    propose_together,
)
from diffdraft.kernels.quantized.row_argmax import greedy_rows
from diffdraft.runtime.loading_thread import LoadingThread
from diffdraft.runtime.sampling import SamplingParams, sample_from
from diffdraft.runtime.stats import StageTimer
from diffdraft.runtime.stopping import StopDecision
from diffdraft.target.families import check_claimed
from diffdraft.target.model import TargetModel, TargetOutput, VerifyInput
from diffdraft.trees import (
    DepthBoundedBuilder,
    DraftTree,
    RoundPlanner,
    RoundSequence,
    TreeBuilder,
    TreeRound,
)


class SpeculativeEngine:
    def __init__(self, target: TargetModel, drafter: Drafter | None, builder: TreeBuilder) -> None:
        self.target = target
        self.drafter = drafter
        self.builder = builder
        self.planner = builder if isinstance(builder, RoundPlanner) else None
        """The builder when it plans rounds (a protocol check is too slow to repeat every round)."""
        self.depth_bound = builder if isinstance(builder, DepthBoundedBuilder) else None
        """The builder when it can say how deep its tree reaches before the drafter runs."""
        if drafter is not None:
            check_claimed(target.config)
        self.layer_ids = list(drafter.target_layer_ids) if drafter is not None else []
        target.check_layer_ids(self.layer_ids)
        self.untapped_plain = (
            self.planner is not None and bool(self.layer_ids) and drafts_across_gaps(drafter)
        )
        """Whether settled plain shared rounds skip the drafter's taps (:meth:`round_layer_ids`)."""
        self.loading_thread = LoadingThread(target.device)
        """Where the engine was built: every sequence starts with a check that it runs there."""
        self.fit = FitCheck(drafter)
        """Says once when the drafter's drafts are almost never accepted (:mod:`.fit_check`)."""

    def start(self, spec: SequenceSpec, drafter: Drafter | None = None) -> SequenceRun:
        """A new sequence; ``drafter``: its own (a fork of the engine's) when several run at once."""
        self.loading_thread.check()
        if drafter is not None and self.drafter is None:
            check_claimed(self.target.config)
        return SequenceRun(self, spec, drafter or self.drafter)

    def run(self, spec: SequenceSpec) -> Iterator[list[int]]:
        """Yield the tokens committed by the prefill and by each round, until a stop condition holds."""
        sequence = self.start(spec)
        yield sequence.prefill()
        while not sequence.done:
            [step] = draft_round([sequence], self.plan([sequence]))
            with sequence.timer("verify"):
                out = self.target.verify(
                    step.cache, step.token_ids, step.position_ids, step.mask, self.layer_ids
                )
            yield sequence.commit(out, sequence.timer.last)

    def plan(self, sequences: Sequence[SequenceRun]) -> list[RoundPlan]:
        """Each sequence's share of this round: when the tree builder plans rounds
        (:class:`~diffdraft.trees.RoundPlanner`), its node budget, and for a sequence left at budget 0
        whose drafter offers a free copy (prompt lookup's), as much of the copy as pays; otherwise
        the builder's own size. The plan's time is charged to the sequences that draft or copy
        (:func:`_charge_plan`)."""
        if self.planner is None:
            return [RoundPlan()] * len(sequences)
        if self.planner.plain_stands(len(sequences)):
            return [PLAIN] * len(sequences)
        begin = time.perf_counter()
        rounds = [RoundSequence(s.stats, s.context, s.draft_depth() > 0) for s in sequences]
        budgets = self.planner.plan(rounds)
        alone = len(sequences) == 1
        if alone:
            begin = time.perf_counter()  # alone, every round is planned: a copy pays its search only
        offers, lengths = self._copies(sequences, budgets)
        _charge_plan(sequences, budgets, lengths, time.perf_counter() - begin, alone)
        return [
            RoundPlan(budget, s.take_copy(offer, length) if length else None)
            for s, budget, offer, length in zip(sequences, budgets, offers, lengths, strict=True)
        ]

    def round_layer_ids(self, plans: Sequence[RoundPlan]) -> list[int]:
        """The target layers a round's forward taps for the drafter: none in a shared round of plain
        plans (no tree, no copy) once plain decoding settled in (:meth:`RoundPlanner.plain_settled`),
        where the drafter drafts across the gap. Under load most rounds are such, and a server that
        tapped none of them served more tokens a second under load (docs/decisions.md, "shared plain
        rounds go untapped"). A copy's round taps: the planner times
        it with the trees' forwards, which tap, and untapped copies made trees look free."""
        if (
            self.untapped_plain
            and len(plans) > 1
            and all(plan.budget == 0 and plan.copy is None for plan in plans)
            and self.planner.plain_settled()
        ):
            return []
        return self.layer_ids

    def _copies(
        self, sequences: Sequence[SequenceRun], budgets: list[int]
    ) -> tuple[list[CopyOffer | None], list[int]]:
        """Each sequence's offered free copy and how much of it to verify (0: none, or none pays).
        In a batch, first whether even the likeliest copies would pay, which spares every sequence's
        lookup under load; alone, straight to the lookup: that question cost about what the lookup
        does and was answered yes in most lone rounds. The same copies either way: no offer expects
        more than the ceiling."""
        none = [None] * len(sequences), [0] * len(sequences)
        if len(sequences) > 1:
            ceilings = [s.copy_ceiling() if b == 0 else None for s, b in zip(sequences, budgets, strict=True)]
            if not any(ceilings) or not any(self.planner.copy_lengths(budgets, ceilings)):
                return none
            offers = [s.copy_offer() if c else None for s, c in zip(sequences, ceilings, strict=True)]
        else:
            offers = [sequences[0].copy_offer() if budgets[0] == 0 else None]
            if offers[0] is None:
                return none
        return offers, self.planner.copy_lengths(budgets, [o and o.expected for o in offers])


def _charge_plan(
    sequences: Sequence[SequenceRun], budgets: list[int], copies: list[int], seconds: float, alone: bool
) -> None:
    """Share a round plan's ``seconds`` among the sequences it gives a free copy (``copies``: copied
    lengths; :attr:`~diffdraft.runtime.stats.GenerationStats.copy_plan_seconds`) or, in a batch, a
    tree (:attr:`~diffdraft.runtime.stats.GenerationStats.draft_plan_seconds`): a batch's plan that
    left every sequence plain stands for several rounds, and one that drafts or copies is made anew
    the next round, so speculating pays for planning. Alone, every round is planned whatever it does
    (``seconds`` is then only the search for a copy)."""
    drafting = [not alone and budget > 0 for budget in budgets]
    paying = sum(length > 0 for length in copies) + sum(drafting)
    if not paying:
        return
    share = seconds / paying
    for sequence, length, draft in zip(sequences, copies, drafting, strict=True):
        if length:
            sequence.stats.copy_plan_seconds += share
        elif draft:
            sequence.stats.draft_plan_seconds += share


@dataclass(frozen=True)
class RoundPlan:
    """One sequence's share of a round."""

    budget: int | None = None
    """Its tree's node budget (None: the builder's own size; 0: no drafter's tree)."""
    copy: Proposal | None = None
    """A free copy to verify instead of a drafter's tree (budget 0 only)."""


PLAIN = RoundPlan(0)
"""A sequence's share of a round that neither drafts nor copies: plain decoding."""


def draft_round(sequences: Sequence[SequenceRun], plans: Sequence[RoundPlan]) -> list[VerifyInput]:
    """Draft and build every sequence's tree of a round (:func:`draft_proposals`, then
    :meth:`SequenceRun.build` each)."""
    proposals = draft_proposals(sequences, plans)
    return [s.build(p, plan.budget) for s, p, plan in zip(sequences, proposals, plans, strict=True)]


def draft_proposals(sequences: Sequence[SequenceRun], plans: Sequence[RoundPlan]) -> list[Proposal]:
    """Every sequence's proposal for a round: one drafter call for all that draft (the drafter's
    forks draft them in one forward where the family can, :func:`propose_together`), its time shared
    evenly among them (a sequence's share recorded apart when its drafter did not build its last
    round's tree: :attr:`~diffdraft.runtime.stats.GenerationStats.catch_up_draft_seconds`). Budget 0:
    the sequence's free copy, if the plan gave it one, else an empty proposal (its pending token is
    verified alone)."""
    budgets = [plan.budget for plan in plans]
    depths = [s.tree_depth(budget) for s, budget in zip(sequences, budgets, strict=True)]
    drafting = [i for i, depth in enumerate(depths) if depth > 0]
    token_ids = [sequences[i].token_ids() for i in drafting]
    proposals = [plan.copy or Proposal() for plan in plans]
    if drafting:
        continuing = {i: sequences[i].stats.drafted_last_round() for i in drafting}
        timer = StageTimer([sequences[i].stats for i in drafting], sequences[0].target.device)
        with timer("draft"):
            drafted = propose_together(
                [sequences[i].drafter for i in drafting], token_ids, [depths[i] for i in drafting]
            )
        share = timer.last / len(drafting)
        for i, ids, proposal in zip(drafting, token_ids, drafted, strict=True):
            proposal.prefix = ids
            proposals[i] = proposal
            if not continuing[i]:
                sequences[i].stats.catch_up_draft_seconds.append(share)
    return proposals


class SequenceRun:
    """One sequence's state in the loop: its KV cache, drafter context, random stream and stats."""

    def __init__(self, engine: SpeculativeEngine, spec: SequenceSpec, drafter: Drafter | None) -> None:
        self.engine = engine
        self.logprobs = spec.logprobs
        self.target = engine.target
        self.drafter = drafter
        self.copier = drafter if isinstance(drafter, CopyingDrafter) else None
        """The drafter when it offers free copies (checked once: a protocol check is slow)."""
        self.stop = spec.stop
        self.sampling = spec.sampling
        self.stats = spec.stats
        self.timer = StageTimer(spec.stats, self.target.device)
        self.generator = None
        if spec.seed is not None:
            self.generator = torch.Generator(device=self.target.device).manual_seed(spec.seed)
        self.prompt_ids = torch.tensor(spec.prompt_ids, dtype=torch.long, device=self.target.device)
        self._prompt_list = list(spec.prompt_ids)
        self.cache = self.target.new_cache()
        self.generated: list[int] = []
        self.decision: StopDecision | None = None
        self._round: tuple[DraftTree, Proposal, int, bool] | None = None
        """The tree awaiting verification, its proposal, context and whether it is a free copy."""
        self.stats.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.decision is not None

    def prefill(self) -> list[int]:
        """Run the prompt through the target; returns the first token."""
        self.stats.started = time.perf_counter()
        if self.drafter is not None:
            self.drafter.reset()
        with self.timer("prefill"):
            out = self.target.prefill(self.cache, self.prompt_ids, self.engine.layer_ids)
            if self.drafter is not None:
                self.drafter.extend_context(out.hidden, 0)
            first = _pick(out.logits[-1], self.sampling, self.generator)
        return self._extend([first], out.logits[-1:])

    @property
    def context(self) -> int:
        """Tokens in the cache: the absolute position of this round's root."""
        return len(self.prompt_ids) + len(self.generated) - 1

    def token_ids(self) -> torch.Tensor:
        """Every committed token, this round's root (not yet in the cache) last."""
        return torch.cat([self.prompt_ids, torch.tensor(self.generated, device=self.prompt_ids.device)])

    def draft_depth(self, budget: int | None = None) -> int:
        """Positions this round drafts: none without a drafter, at budget 0 (plain decoding) or when
        only the root's own next token is left to generate."""
        if self.drafter is None or budget == 0:
            return 0
        return max(0, min(self.drafter.max_depth, self.stop.remaining(len(self.generated)) - 1))

    def tree_depth(self, budget: int | None) -> int:
        """Positions the drafter proposes for this round's tree: :meth:`draft_depth`, cut to what the
        builder's tree can reach when it says so (positions past it would be drafted for nothing)."""
        depth = self.draft_depth(budget)
        bound = self.engine.depth_bound
        return min(depth, bound.deepest(budget, self.stats)) if depth and bound is not None else depth

    def copy_ceiling(self) -> list[float] | None:
        """The most a free copy could expect this round (None: no drafter that copies, or no token
        left to draft): :meth:`CopyingDrafter.copy_ceiling`."""
        depth = self.draft_depth()
        if self.copier is None or depth == 0:
            return None
        return self.copier.copy_ceiling(depth)

    def copy_offer(self) -> CopyOffer | None:
        """The free copy the drafter offers this round (None: none, or no token left to draft)."""
        depth = self.draft_depth()
        if self.copier is None or depth == 0:
            return None
        return self.copier.copy_offer(self._prompt_list + self.generated, depth)

    def take_copy(self, offer: CopyOffer, length: int) -> Proposal:
        """The first ``length`` tokens of ``offer``, which the round plan chose to verify (timed as
        building its tree)."""
        with self.timer("tree"):
            proposal = self.copier.take_copy(offer, length, self._prompt_list + self.generated)
        self.stats.copy_seconds += self.timer.last
        return proposal

    def build(self, proposal: Proposal, budget: int | None = None) -> VerifyInput:
        """Build this round's tree from the drafter's ``proposal`` (empty: the root alone) at the
        round plan's ``budget`` (None: the builder's own size; 0 with a proposal of tokens: the free
        copy the plan chose, verified as a chain); the returned input is what the target must verify."""
        start = self.context
        copied = budget == 0 and proposal.tokens is not None and proposal.depth > 0
        with self.timer("tree"):
            root = self.generated[-1]
            if proposal.depth == 0:
                tree = DraftTree.root_only(root, self.target.device)
            elif copied:
                tree = DraftTree.chain(root, proposal.tokens.to(self.target.device))
            else:
                tree_round = TreeRound(
                    root,
                    proposal,
                    self.sampling,
                    self.generator,
                    context=start,
                    stats=self.stats,
                    budget=budget,
                )
                tree = self.engine.builder.build(tree_round)
        building = self.timer.last
        with self.timer("mask"):
            mask = self.target.attention_mask(self.cache, tree.ancestor_mask()) if tree.num_nodes else None
        if copied:
            self.stats.copy_seconds += building + self.timer.last
        elif proposal.depth:
            self.stats.draft_build_seconds += building + self.timer.last
        self._round = (tree, proposal, start, copied)
        return VerifyInput(self.cache, tree.tokens, tree.position_ids(start), mask)

    def commit(
        self, out: TargetOutput, verify_seconds: float, forward: tuple[int, int, int] | None = None
    ) -> list[int]:
        """Accept from the verified tree, keep its accepted path; returns the tokens this round added
        (cut at a stop condition). ``verify_seconds``: the forward's time, recorded in the stats with
        its ``forward`` shape (sequences, tokens, mean cached tokens; None: this tree alone)."""
        tree, proposal, start, copied = self._round
        self._round = None
        self.stats.verify_seconds.append(verify_seconds)
        self.stats.verify_forwards.append(forward or (1, tree.num_nodes + 1, start))
        with self.timer("accept"):
            result = accept(tree, out.logits, self.sampling, self.generator)
        with self.timer("commit"):
            self.target.keep_path(self.cache, start, result.path)
            path = _rows(result.path)
            if self.drafter is not None:
                hidden = out.hidden[path] if out.hidden is not None else None
                sequences, rows = forward[:2] if forward else (1, tree.num_nodes + 1)  # the taps' rows
                if isinstance(path, slice) and hidden is not None and rows > sequences:
                    # a slice is a view: it would keep rows nobody accepted alive while the drafter
                    # waits to draft (a list index already copies); a round that verified one token
                    # a sequence keeps every row (under load, most rounds)
                    hidden = hidden.clone()
                self.drafter.extend_context(hidden, start)
            new = [*tree.tokens[path][1:].tolist(), result.next_token]
        stats = self.stats
        stats.rounds += 1
        stats.acceptance_lengths.append(len(new))
        stats.accepted_nodes.append(result.path[1:])
        stats.draft_depths.append(proposal.depth)
        if copied:
            stats.copy_rounds.append(len(stats.tree_sizes))
        elif proposal.depth:
            self.engine.fit.record(len(new) - 1)
        stats.tree_sizes.append(tree.num_nodes)
        stats.verify_contexts.append(start)
        return self._extend(new, out.logits[path] if self.logprobs is not None else None)

    def _extend(self, new: list[int], logits: torch.Tensor | None) -> list[int]:
        """Commit ``new`` (cut at a stop condition); ``logits`` [len(new), V]: the distribution each
        was committed from (needed only when log-probabilities are recorded)."""
        self.generated.extend(new)
        self.decision = self.stop.check(self.generated, len(new))
        if self.decision is not None:
            new = new[: max(0, len(new) - (len(self.generated) - self.decision.keep))]
            self.stats.stop_reason = self.decision.reason
            self.stats.total_seconds = time.perf_counter() - self.stats.started
        if self.logprobs is not None:
            self.logprobs.record(logits, new)
        return new


def _rows(path: list[int]) -> list[int] | slice:
    """The accepted ``path`` (rising tree indices from the root 0) as an index of the tree's rows: a
    slice when it is the first rows, as every chain's and plain decoding's is (a list index costs
    several times a slice, paid by every sequence every round)."""
    return slice(0, len(path)) if path[-1] == len(path) - 1 else path


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(greedy_rows(logits))
    return int(sample_from(sampling.probs(logits), generator))
