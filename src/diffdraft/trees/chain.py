"""The simplest tree: one token per drafted position.

Greedy decoding takes the drafter's argmax. Sampling draws each token from the drafter's
distribution warped exactly like the target's, and keeps that distribution on the tree so the
verifier can run rejection sampling, which accepts more than matching target samples would.
"""

from __future__ import annotations

from diffdraft.runtime.sampling import sample_from
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
        draft_probs = sampling.probs(proposal.log_probs)
        return DraftTree.chain(root_token, sample_from(draft_probs, tree_round.generator), draft_probs)
