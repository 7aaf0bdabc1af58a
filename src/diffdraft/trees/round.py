"""What a round hands a tree rule: a planner's view of each sequence before it drafts
(:class:`RoundSequence`), and a builder's inputs once it has (:class:`TreeRound`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats


@dataclass(frozen=True)
class RoundSequence:
    """What a round planner knows of one sequence before its round drafts."""

    stats: GenerationStats
    """Its record so far."""
    context: int
    """Cached tokens its tree will be verified over."""
    can_draft: bool
    """False when it has no token left to draft for (it verifies its last token alone)."""


@dataclass(frozen=True)
class TreeRound:
    """One sequence's round as its tree builder sees it, once the drafter has proposed."""

    root_token: int
    """The tree's root: the sequence's last committed token, not yet in the target's cache."""
    proposal: Proposal
    """The drafter's proposal for the positions after the root; the tree covers at most
    ``proposal.depth`` of them."""
    sampling: SamplingParams
    """How the target samples: a builder that samples its draft warps the drafter's distributions
    the same way."""
    generator: torch.Generator | None
    """The sequence's random stream, for a builder that samples its draft (None: the global one)."""
    context: int = 0
    """Cached tokens the target verifies the tree over: what a cost-aware builder sizes it by."""
    stats: GenerationStats | None = None
    """The sequence's record so far, so a builder that adapts to a sequence decides by that sequence's
    own rounds when several are decoded at once (None: nobody keeps one)."""
    budget: int | None = None
    """The round plan's node budget (:class:`~diffdraft.trees.RoundPlanner`); None: the builder's own
    size. Builders that do not plan ignore it."""
