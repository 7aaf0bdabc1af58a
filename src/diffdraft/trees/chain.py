"""The simplest tree: one token per drafted position.

Greedy decoding takes the drafter's argmax. Sampling draws each token from the drafter's
distribution warped exactly like the target's, and keeps that distribution on the tree so the
verifier can run rejection sampling, which accepts more than matching target samples would. Where
a position's distribution depends on the token drafted before it (DSpark, DFlash2), each token is
drawn after the token sampled before it, left to right as vLLM's walk draws them, and the tree keeps
that conditional: rejection sampling tests each token against the very distribution it was drawn
from, the drafter's given the tokens before it, which it tests only once those were accepted.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams, sample_from
from diffdraft.trees.round import TreeRound
from diffdraft.trees.tree import DraftTree


class ChainBuilder:
    """Turns a proposal into a single path root -> d_1 -> ... -> d_L."""

    def build(self, tree_round: TreeRound) -> DraftTree:
        """Reads the round's ``root_token``, ``proposal``, ``sampling`` and ``generator``; ``context``,
        ``stats`` and ``budget`` are unused: a chain is as long as the proposal."""
        root_token, proposal, sampling = tree_round.root_token, tree_round.proposal, tree_round.sampling
        if proposal.tokens is not None:
            return DraftTree.chain(root_token, proposal.tokens)
        if not proposal.has_distributions:
            return DraftTree.root_only(root_token)
        if proposal.depth == 0:
            return DraftTree.root_only(root_token, proposal.device)
        if sampling.greedy:
            return DraftTree.chain(root_token, proposal.top(1)[1][:, 0])
        if proposal.conditionals is not None:
            tokens, draft_probs = _sampled_walk(root_token, proposal, sampling, tree_round.generator)
            return DraftTree.chain(root_token, tokens, draft_probs)
        draft_probs = sampling.probs(proposal.log_probs)
        return DraftTree.chain(root_token, sample_from(draft_probs, tree_round.generator), draft_probs)


def _sampled_walk(
    root_token: int, proposal: Proposal, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [depth], the warped distributions [depth, V] they were drawn from): each position's
    token drawn after the one drawn before it (the root before the first)."""
    previous = torch.tensor([root_token], device=proposal.device)
    tokens, rows = [], []
    for position in range(proposal.depth):
        probs = sampling.probs(proposal.log_probs_after(position, previous))
        previous = sample_from(probs, generator)
        tokens.append(previous)
        rows.append(probs)
    return torch.cat(tokens), torch.cat(rows)
