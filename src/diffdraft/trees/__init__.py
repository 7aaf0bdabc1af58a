"""Draft trees and the builders that turn a drafter's proposal into one."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.sampling import SamplingParams
from diffdraft.stats import GenerationStats
from diffdraft.trees.chain import ChainBuilder
from diffdraft.trees.ddtree import DDTreeBuilder
from diffdraft.trees.tree import DraftTree

__all__ = ["ChainBuilder", "DDTreeBuilder", "DraftTree", "TreeBuilder"]


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
