"""What every drafter gives the engine: a :class:`Proposal` for the positions after the root.

The engine never learns a drafter's name. It tells the drafter which target layers to tap
(``target_layer_ids``), feeds it the taps of every token that enters the target's KV cache
(``extend_context``), and asks for one proposal per round (``propose``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from diffdraft.kernels.quantized.row_topk import top_rows

if TYPE_CHECKING:
    from diffdraft.drafters.conditionals import Conditionals


class Proposal:
    """Draft for the ``depth`` positions that follow the root token.

    One-pass parallel drafters give per-position distributions (``log_probs``), copy-based drafters
    (prompt lookup) an explicit token chain (``tokens``); a proposal with neither drafts nothing. A
    proposal is handed over: its tensors are fresh, and the receiver may change them in place.

    A drafter that scores only its draft vocabulary hands over those columns (:meth:`restricted`):
    tree builders rank the few thousand tokens it scores, and the full [depth, V] rows, every other
    token at probability 0, are only written out for a consumer that reads ``log_probs``.

    A drafter whose distribution at a position depends on the token drafted before it (DSpark,
    DFlash2) hands over a :class:`~diffdraft.drafters.conditional_proposal.ConditionalProposal`: its
    :attr:`conditionals` give the rows after any predecessor, and its rows here are the greedy
    chain's.
    """

    def __init__(
        self,
        log_probs: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ) -> None:
        self._log_probs = log_probs
        self.tokens = tokens
        """[depth] explicit candidate chain."""
        self.prefix = prefix
        """Every committed token, the root last. The engine attaches it, for tree builders that score
        how drafted tokens continue the text (DART's N-gram term)."""
        self._scored: torch.Tensor | None = None
        self._vocab: torch.Tensor | None = None
        self._vocab_size = 0
        self._columns: Mapping[int, int] | None = None
        self._added: dict[int, int] = {}
        """Columns :meth:`scores_of` added for tokens outside the draft vocabulary (``_columns`` is
        the drafter's, shared by every proposal)."""

    @classmethod
    def restricted(
        cls,
        scored: torch.Tensor,
        vocab: torch.Tensor | None,
        vocab_size: int,
        columns: Mapping[int, int] | None = None,
    ) -> Proposal:
        """A proposal over token ids ``vocab`` only: ``scored`` [depth, len(vocab)] are
        their log-probabilities, and every other of the ``vocab_size`` tokens has probability 0.
        ``vocab`` None (a drafter without a draft vocabulary): ``scored`` [depth, vocab_size] score
        every token, and they are the proposal's ``log_probs``. ``columns``: each of ``vocab``'s ids'
        column (the drafter's, built once), which lets :meth:`scores_of` find tokens without
        writing out whole rows."""
        if vocab is None:
            return cls(log_probs=scored)
        proposal = cls()
        proposal._scored, proposal._vocab, proposal._vocab_size = scored, vocab, vocab_size
        proposal._columns = columns
        return proposal

    def scores_of(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns): the proposal's log-probabilities [depth, width] to change in place, and
        where each of ``token_ids`` is in them, a [len(token_ids)] index. The scored columns alone
        when :meth:`restricted` was given their columns, widened first by a column of probability 0
        for each of those tokens outside the draft vocabulary (a few columns, where writing out the
        rows costs the whole vocabulary's), else the whole [depth, V] :attr:`log_probs`."""
        if self._log_probs is None and self._columns is not None:
            missing = [token for token in dict.fromkeys(token_ids) if self._column(token) is None]
            if missing:
                self._add_columns(missing)
            columns = [self._column(token) for token in token_ids]
            return self._scored, torch.tensor(columns, device=self._scored.device)
        rows = self.log_probs
        return rows, torch.tensor(list(token_ids), device=rows.device)

    def extended(self, rows: int) -> Proposal:
        """This proposal with ``rows`` more depths at which every token it scores is equally likely
        (its draft vocabulary's, or without one the whole vocabulary's)."""
        if self._log_probs is not None or self._scored is None:
            return Proposal(log_probs=torch.cat([self.log_probs, _uniform(self.log_probs, rows)]))
        scored = torch.cat([self._scored, _uniform(self._scored, rows)])
        longer = Proposal.restricted(scored, self._vocab, self._vocab_size, self._columns)
        longer._added = dict(self._added)
        return longer

    def _column(self, token: int) -> int | None:
        column = self._columns.get(token)
        return self._added.get(token) if column is None else column

    def _add_columns(self, token_ids: list[int]) -> None:
        """Score ``token_ids`` (none in the draft vocabulary) too, each at probability 0 everywhere."""
        width = self._scored.shape[1]
        self._added.update((token, width + i) for i, token in enumerate(token_ids))
        never = self._scored.new_full((self._scored.shape[0], len(token_ids)), float("-inf"))
        self._scored = torch.cat([self._scored, never], dim=1)
        added = torch.tensor(token_ids, dtype=self._vocab.dtype, device=self._vocab.device)
        self._vocab = torch.cat([self._vocab, added])

    @property
    def log_probs(self) -> torch.Tensor | None:
        """[depth, V] float32 log-probabilities; row d is the drafter's marginal for depth d + 1."""
        if self._log_probs is None and self._scored is not None:
            full = self._scored.new_full((self._scored.shape[0], self._vocab_size), float("-inf"))
            self._log_probs = full.index_copy_(1, self._vocab, self._scored)
        return self._log_probs

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (log-probabilities, token ids) [depth, k'] of the ``k`` likeliest tokens at each depth,
        most likely first; k' = min(k, tokens the drafter scores)."""
        if self._log_probs is None and self._scored is not None:
            values, columns = top_rows(self._scored, min(k, self._scored.shape[1]))
            return values, self._vocab[columns]
        return top_rows(self.log_probs, min(k, self.log_probs.shape[1]))

    def log_probs_after(self, position: int, previous: torch.Tensor) -> torch.Tensor:
        """[n, V] log-probabilities of depth ``position + 1`` after each of the ``previous`` [n] tokens
        drafted at depth ``position`` (the root at 0): the rows :attr:`conditionals` give, else the
        depth's one row for every predecessor."""
        return self.log_probs[position].expand(previous.shape[0], -1)

    @property
    def conditionals(self) -> Conditionals | None:
        """Where a position's distribution depends on the token drafted before it (DSpark, DFlash2):
        the rows after any predecessor
        (:class:`~diffdraft.drafters.conditional_proposal.ConditionalProposal`). None: the positions
        are independent, and the rows above are all there is."""
        return None

    @property
    def has_distributions(self) -> bool:
        """Whether the drafter gave per-position distributions (read without writing them out)."""
        return self._log_probs is not None or self._scored is not None

    @property
    def device(self) -> torch.device:
        """Where the proposal's distributions or tokens are."""
        source = self._log_probs if self._log_probs is not None else self._scored
        return (source if source is not None else self.tokens).device

    @property
    def depth(self) -> int:
        source = self._log_probs if self._log_probs is not None else self._scored
        source = source if source is not None else self.tokens
        return 0 if source is None else int(source.shape[0])


def _uniform(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows of log-probabilities as wide as ``rows``, every column equally likely."""
    return rows.new_full((count, rows.shape[1]), -math.log(rows.shape[1]))


def vocab_columns(vocab: torch.Tensor | None) -> dict[int, int] | None:
    """Each token id of a draft vocabulary -> its column in the drafter's scores (for
    :meth:`Proposal.restricted`; built once per drafter); None without a draft vocabulary."""
    return None if vocab is None else {token: column for column, token in enumerate(vocab.tolist())}


@runtime_checkable
class Drafter(Protocol):
    """A source of draft tokens for the speculative loop."""

    max_depth: int
    """How many positions after the root one proposal can cover (block_size - 1 for DFlash)."""
    target_layer_ids: list[int]
    """Target decoder layers whose outputs the drafter needs (empty for drafters that need none)."""

    def reset(self) -> None:
        """Forget all context: a new generation starts."""

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        """Tokens at absolute positions ``start .. start + n - 1`` entered the target's KV cache.

        ``hidden`` is [n, len(target_layer_ids), hidden_size] (None when no layers are tapped).
        """

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        """Draft ``depth`` positions after ``token_ids[-1]`` (the root; all committed tokens given)."""

    def fork(self) -> Drafter:
        """A drafter with an empty context that shares this one's weights: one per sequence when
        several sequences are decoded at once."""


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter whose forks can draft several sequences in one forward (the weights read once)."""

    def propose_batch(
        self, forks: Sequence[Drafter], token_ids: Sequence[torch.Tensor], depths: Sequence[int]
    ) -> list[Proposal]:
        """What ``fork.propose(ids, depth)`` gives for each fork of this drafter (itself included)."""
        ...


@dataclass(frozen=True)
class CopyOffer:
    """A continuation a drafter can propose without running a model (prompt lookup's copy of what
    followed an earlier occurrence of the context's last n-gram)."""

    tokens: list[int]
    ngram: int
    """The matched n-gram's length (longer matches are likelier to continue the same way)."""
    expected: list[float]
    """The expected acceptance length (bonus token included) when its first k tokens are verified,
    for k = 0 .. len(tokens): what a round plan weighs against the tokens' verification cost."""


@runtime_checkable
class CopyingDrafter(Protocol):
    """A drafter that can also offer a free copy: a round plan that gives its sequence no tree (its
    drafter forward does not pay at that batch) may still verify the copy's likeliest tokens."""

    def copy_offer(self, token_ids: list[int], depth: int) -> CopyOffer | None:
        """The copy for the ``depth`` positions after ``token_ids[-1]`` (every committed token, the
        root last), or None when there is none."""
        ...

    def copy_ceiling(self, depth: int) -> list[float]:
        """The most any offer of up to ``depth`` tokens can expect now, per copied length (as
        :attr:`CopyOffer.expected`): a round plan in which even this would not pay skips looking for
        the copy. The same list object while it holds."""
        ...

    def take_copy(self, offer: CopyOffer, length: int, token_ids: list[int]) -> Proposal:
        """The proposal of the offer's first ``length`` tokens (for the same ``token_ids``), which the
        round verifies: the drafter learns from what the target makes of it."""
        ...


@runtime_checkable
class GapTolerantDrafter(Protocol):
    """A drafter that may draft on from a context with gaps: committed tokens whose target states never
    reached it (``extend_context`` got None for them). Rounds that nobody drafts in can then verify
    without tapping the target's layers: under load most rounds are such."""

    def tolerates_gaps(self) -> bool:
        """Whether this drafter (a wrapper: the drafter it wraps) drafts from the rows it has."""
        ...


def drafts_across_gaps(drafter: Drafter | None) -> bool:
    """Whether ``drafter`` is a :class:`GapTolerantDrafter` that says it tolerates gaps."""
    return isinstance(drafter, GapTolerantDrafter) and drafter.tolerates_gaps()


def propose_together(
    drafters: Sequence[Drafter], token_ids: Sequence[torch.Tensor], depths: Sequence[int]
) -> list[Proposal]:
    """One proposal per drafter (forks of one drafter, each with its sequence's context): in one
    call where the family drafts in batches, else one after another."""
    first = drafters[0] if drafters else None
    if len(drafters) > 1 and isinstance(first, BatchDrafter):
        return first.propose_batch(drafters, token_ids, depths)
    return [d.propose(ids, depth) for d, ids, depth in zip(drafters, token_ids, depths, strict=True)]


class ForksByCopy:
    """``fork`` for drafters whose ``reset`` rebinds (never mutates) every piece of per-sequence
    state: a shallow copy shares the weights, and its reset gives it state of its own."""

    def fork(self) -> Drafter:
        clone = copy.copy(self)
        clone.reset()
        return clone
