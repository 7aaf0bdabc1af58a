"""DDTree: the optimal draft tree from one pass of per-position drafter marginals.

Under the factorized surrogate (the drafter's depths are independent), the tree of at most B nodes
that maximizes expected acceptance length is the B most probable prefixes (DDTree, Prop. 2), and
only the top-K tokens per depth with K = min(B, V) can appear in it (Lemma 1). A best-first heap
enumerates those prefixes in descending probability without visiting the rest (Algorithm 1): each
pop yields one node and pushes at most its next sibling and its first child.
"""

from __future__ import annotations

import heapq
import math

import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees.round import TreeRound
from diffdraft.trees.tree import MAX_TREE_NODES, DraftTree


class DDTreeBuilder:
    """Best-first top-``budget`` prefix tree over the drafter's raw (unwarped) log-probs.

    Nodes come out in pop order, i.e. by non-increasing prefix probability. A parent is always
    popped before its child and a sibling before the next one, so parents precede children and
    each node's children are listed most probable first, the order verifiers try them in.
    Candidates of probability zero are never added: they cannot raise expected acceptance.
    """

    def __init__(self, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InvalidRequestError(
                f"ddtree budget must be an integer >= 1 (the number of drafted nodes), got {budget!r}; "
                "pass e.g. --budget 32"
            )
        if budget > MAX_TREE_NODES:
            raise InvalidRequestError(
                f"ddtree budget must be at most {MAX_TREE_NODES} nodes (a larger tree costs more to verify "
                f"than any round can gain), got {budget}; pass e.g. --budget 32, or 'auto'"
            )
        self.budget = budget

    def deepest(self, budget: int | None = None, stats: GenerationStats | None = None) -> int:
        """A tree of this builder's ``budget`` nodes reaches that many positions at most (a chain); the
        round's plan and record are unused."""
        return self.budget

    def build(self, tree_round: TreeRound) -> DraftTree:
        """Reads the round's ``root_token`` and ``proposal``; ``sampling``, ``generator``, ``context``,
        ``stats`` and ``budget`` are unused: the tree is deterministic, its size fixed, and the sampling
        walk verifier keeps it lossless at any temperature."""
        return self.ranked(tree_round)[0]

    def ranked(self, tree_round: TreeRound) -> tuple[DraftTree, list[float]]:
        """:meth:`build`'s tree with each node's prefix log-probability under the drafter (root: 0),
        non-increasing along the nodes: the heap computed them, and the auto budget's surrogate is
        their running sum (recomputing them from the tree took longer than building the tree;
        docs/decisions.md, "the surrogate sums the heap's scores")."""
        root_token, proposal = tree_round.root_token, tree_round.proposal
        if not proposal.has_distributions:
            if proposal.tokens is not None:
                raise InvalidRequestError(
                    "ddtree needs a drafter that gives distributions; use --method chain for prompt lookup"
                )
            return DraftTree.root_only(root_token), [0.0]
        values, ids = proposal.top(self.budget)
        depth, device = values.shape[0], values.device
        if depth == 0:
            return DraftTree.root_only(root_token, device), [0.0]
        ranked_scores: list[list[float]] = values.float().cpu().tolist()
        ranked_tokens: list[list[int]] = ids.cpu().tolist()
        k = len(ranked_tokens[0])

        tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
        # Entries: (-prefix score, parent node, position (depth - 1), rank at that position).
        best = ranked_scores[0][0]
        heap = [(-best, 0, 0, 0)] if best > -math.inf else []
        while heap and len(tokens) <= self.budget:
            neg_score, parent, pos, rank = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(ranked_tokens[pos][rank])
            parents.append(parent)
            depths.append(pos + 1)
            scores.append(-neg_score)
            if rank + 1 < k:
                sibling = scores[parent] + ranked_scores[pos][rank + 1]
                if sibling > -math.inf:
                    heapq.heappush(heap, (-sibling, parent, pos, rank + 1))
            if pos + 1 < depth:
                child = scores[node] + ranked_scores[pos + 1][0]
                if child > -math.inf:
                    heapq.heappush(heap, (-child, node, pos + 1, 0))

        tree = DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            parents=torch.tensor(parents, dtype=torch.long, device=device),
            depths=torch.tensor(depths, dtype=torch.long, device=device),
        )
        return tree, scores
