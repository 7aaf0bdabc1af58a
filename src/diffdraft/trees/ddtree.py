"""DDTree: the optimal draft tree from one pass of the drafter's distributions.

Under the factorized surrogate (the drafter's depths are independent), the tree of at most B nodes
that maximizes expected acceptance length is the B most probable prefixes (DDTree, Prop. 2), and
only the top-K tokens per depth with K = min(B, V) can appear in it (Lemma 1). A best-first heap
enumerates those prefixes in descending probability without visiting the rest (Algorithm 1): each
pop yields one node and pushes at most its next sibling and its first child.

Where a position's distribution depends on the token drafted before it (DSpark's Markov head,
DFlash2's candidate selector: the proposal's ``conditionals``), the drafter's distribution over a
path is the chain-rule product of the rows along it, each after the path's own previous token. The
same heap still gives the optimal tree for it. A tree's expected acceptance length under the
drafter's joint is the sum, over its nodes, of the probability of the node's path (a token is
accepted only with its whole path); every path's probability shrinks along it (each factor is a
probability), so the B most probable paths are closed under prefixes and form the best tree of B
nodes; and they are what the heap pops when each node's children are ranked by its own conditional
row (a node's best child is its likeliest continuation, its next sibling the parent's next
likeliest). Lemma 1 holds per node: only a node's top min(B, V) successors can enter. A node's row
is computed when the heap first expands it (with those of a few of its next siblings, in one call),
never for a node the tree cannot extend.
"""

from __future__ import annotations

import heapq
import math

import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees.round import TreeRound
from diffdraft.trees.successors import ConditionalRanks, DepthRanks, SuccessorRanks
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
        """:meth:`build`'s tree with each node's prefix log-probability under the drafter (root: 0;
        its chain-rule joint where the proposal has conditionals), non-increasing along the nodes:
        the heap computed them, and the auto budget's surrogate is their running sum (recomputing
        them from the tree took longer than building the tree; docs/decisions.md, "the surrogate
        sums the heap's scores")."""
        root_token, proposal = tree_round.root_token, tree_round.proposal
        if not proposal.has_distributions:
            if proposal.tokens is not None:
                raise InvalidRequestError(
                    "ddtree needs a drafter that gives distributions; use --method chain for prompt lookup"
                )
            return DraftTree.root_only(root_token), [0.0]
        conditionals = proposal.conditionals
        if conditionals is not None:
            depth, device = proposal.depth, proposal.device
            ranks: SuccessorRanks = ConditionalRanks(conditionals)
        else:
            values, ids = proposal.top(self.budget)
            depth, device = values.shape[0], values.device
            ranks = DepthRanks(values.float().cpu().tolist(), ids.cpu().tolist())
        if depth == 0:
            return DraftTree.root_only(root_token, device), [0.0]
        return self._best_first(root_token, ranks, depth, device)

    def _best_first(
        self, root_token: int, ranks: SuccessorRanks, depth: int, device: torch.device
    ) -> tuple[DraftTree, list[float]]:
        """The top-``budget`` prefix tree over ``depth`` positions, each node's children from ``ranks``."""
        tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
        children = [ranks.successors(0, [root_token], 0, self.budget)]  # per node (none past the last)
        # Entries: (-prefix score, parent node, the child's rank among the parent's successors); a
        # parent's depth is fixed, so ties break as they did when entries also held the position.
        best = children[0][0][0] if children[0][0] else -math.inf
        heap = [(-best, 0, 0)] if best > -math.inf else []
        while heap and len(tokens) <= self.budget:
            neg_score, parent, rank = heapq.heappop(heap)
            ranked_scores, ranked_tokens = children[parent]
            node = len(tokens)
            tokens.append(ranked_tokens[rank])
            parents.append(parent)
            depths.append(depths[parent] + 1)
            scores.append(-neg_score)
            if rank + 1 < len(ranked_tokens):
                sibling = scores[parent] + ranked_scores[rank + 1]
                if sibling > -math.inf:
                    heapq.heappush(heap, (-sibling, parent, rank + 1))
            room = self.budget + 1 - len(tokens)  # nodes the tree may still take
            if depths[node] < depth and room > 0:
                children.append(ranks.successors(depths[node], ranked_tokens, rank, room))
                child_scores = children[node][0]
                child = scores[node] + child_scores[0] if child_scores else -math.inf
                if child > -math.inf:
                    heapq.heappush(heap, (-child, node, 0))
            else:
                children.append(([], []))

        tree = DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            parents=torch.tensor(parents, dtype=torch.long, device=device),
            depths=torch.tensor(depths, dtype=torch.long, device=device),
        )
        return tree, scores
