"""Draft trees and the builders that turn a drafter's proposal into one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees.chain import ChainBuilder
from diffdraft.trees.ddtree import DDTreeBuilder
from diffdraft.trees.tree import DraftTree

__all__ = ["ChainBuilder", "DDTreeBuilder", "DraftTree", "RoundPlanner", "RoundSequence", "TreeBuilder"]


@runtime_checkable
class TreeBuilder(Protocol):
    """Decides which tokens the target verifies this round; the engine knows only this call."""

    def build(
        self,
        root_token: int,
        proposal: Proposal,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        context: int = 0,
        stats: GenerationStats | None = None,
    ) -> DraftTree:
        """A tree rooted at ``root_token`` covering at most ``proposal.depth`` positions; the target
        will verify it over ``context`` cached tokens (what a cost-aware builder sizes it by).
        ``stats``: the sequence's record so far, so a builder that adapts to a sequence decides by
        that sequence's own rounds when several are decoded at once."""
        ...


@dataclass(frozen=True)
class RoundSequence:
    """What a round planner knows of one sequence before its round drafts."""

    stats: GenerationStats
    """Its record so far."""
    context: int
    """Cached tokens its tree will be verified over."""
    can_draft: bool
    """False when it has no token left to draft for (it verifies its last token alone)."""


@runtime_checkable
class RoundPlanner(Protocol):
    """A tree builder that sizes the trees of all sequences sharing a round's verification forward
    together, before they draft: budget 0 means the sequence does not draft this round and verifies
    its pending token alone (plain decoding)."""

    def plan(self, sequences: Sequence[RoundSequence]) -> list[int]:
        """One node budget per sequence, in order."""
        ...

    def build(
        self,
        root_token: int,
        proposal: Proposal,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        context: int = 0,
        stats: GenerationStats | None = None,
        budget: int | None = None,
    ) -> DraftTree:
        """:meth:`TreeBuilder.build` of a tree of about ``budget`` nodes (the plan's)."""
        ...
