"""What every drafter gives the engine: a :class:`Proposal` for the positions after the root.

The engine never learns a drafter's name. It tells the drafter which target layers to tap
(``target_layer_ids``), feeds it the taps of every token that enters the target's KV cache
(``extend_context``), and asks for one proposal per round (``propose``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Proposal:
    """Draft for the ``depth`` positions that follow the root token.

    Exactly one of ``log_probs`` and ``tokens`` is set: one-pass parallel drafters give per-position
    distributions, copy-based drafters (prompt lookup) give an explicit token chain. A proposal is
    handed over: its tensors are fresh, and the receiver may change them in place.
    """

    log_probs: torch.Tensor | None = None
    """[depth, V] float32 log-probabilities; row d is the drafter's marginal for depth d + 1."""
    tokens: torch.Tensor | None = None
    """[depth] explicit candidate chain."""
    prefix: torch.Tensor | None = None
    """Every committed token, the root last. The engine attaches it, for tree builders that score
    how drafted tokens continue the text (DART's N-gram term)."""

    @property
    def depth(self) -> int:
        source = self.log_probs if self.log_probs is not None else self.tokens
        return 0 if source is None else int(source.shape[0])


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
