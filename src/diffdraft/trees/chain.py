"""The simplest tree: one token per drafted position.

Greedy decoding takes the drafter's argmax. Sampling draws each token from the drafter's
distribution warped exactly like the target's, and keeps that distribution on the tree so the
verifier can run rejection sampling, which accepts more than matching target samples would.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams, sample_from
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees.tree import DraftTree


class ChainBuilder:
    """Turns a proposal into a single path root -> d_1 -> ... -> d_L."""

    def build(
        self,
        root_token: int,
        proposal: Proposal,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        context: int = 0,
        stats: GenerationStats | None = None,
    ) -> DraftTree:
        """``context`` and ``stats`` are unused: a chain is as long as the proposal."""
        if proposal.tokens is not None:
            return DraftTree.chain(root_token, proposal.tokens)
        if not proposal.has_distributions:
            return DraftTree.root_only(root_token)
        if proposal.depth == 0:
            return DraftTree.root_only(root_token, proposal.device)
        if sampling.greedy:
            return DraftTree.chain(root_token, proposal.top(1)[1][:, 0])
        draft_probs = sampling.probs(proposal.log_probs)
        return DraftTree.chain(root_token, sample_from(draft_probs, generator), draft_probs)
