"""The draft tree every builder produces and every verifier consumes.

Node 0 is the root: the last committed token that is not yet in the target's KV cache (the
previous round's bonus token). Nodes 1..N are drafted tokens; a chain is a tree whose parents
are ``i - 1``. Everything the verification forward needs (ancestor mask, depth-based position
ids) is derived here, so builders only decide *which* tokens to try.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TREE_NODES = 4096
"""The most drafted nodes a tree may have (a DDTree budget, a DART tree size). A tree is verified in
one target forward over its N + 1 tokens: its ancestor mask holds (N + 1)^2 entries and attention
(N + 1) x (context + N + 1) scores per head, so memory grows with N^2 and every round costs what
prefilling N tokens does. At 4096 nodes that is a 17 MB mask and 67 MB of float32 scores per head
(2 GB for a 32-head layer where attention materializes them), far past what a round can gain: it
accepts at most the drafter's depth + 1 tokens (17 for a block-16 DFlash drafter), and the auto
budget plans no more than 256 nodes (:data:`diffdraft.budget.cost.MAX_BUDGET`). A budget of 1e9 was
taken and built its tree node by node for minutes, memory growing by 25 MB/s, a tree no forward
could verify."""


@dataclass
class DraftTree:
    tokens: torch.Tensor
    """[N + 1] token ids; tokens[0] is the root."""
    parents: torch.Tensor
    """[N + 1] index of each node's parent; parents[0] == -1. Parents always precede children."""
    depths: torch.Tensor
    """[N + 1] depth of each node; depths[0] == 0."""
    draft_probs: torch.Tensor | None = None
    """[N + 1, V] for trees whose tokens were *sampled* from the drafter: row i is the
    distribution node i's token was drawn from (row 0 unused). Enables rejection sampling."""

    @classmethod
    def root_only(cls, root_token: int, device: torch.device | str = "cpu") -> DraftTree:
        return cls(
            tokens=torch.tensor([root_token], dtype=torch.long, device=device),
            parents=torch.tensor([-1], dtype=torch.long, device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
        )

    @classmethod
    def chain(
        cls, root_token: int, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        """A single path root -> tokens[0] -> tokens[1] ...; ``draft_probs`` is [len(tokens), V]."""
        device = tokens.device
        n = tokens.shape[0]
        all_tokens = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), tokens.long()])
        probs = None
        if draft_probs is not None:
            probs = torch.cat([torch.zeros_like(draft_probs[:1]), draft_probs])
        return cls(
            tokens=all_tokens,
            parents=torch.arange(-1, n, device=device),
            depths=torch.arange(0, n + 1, device=device),
            draft_probs=probs,
        )

    @property
    def num_nodes(self) -> int:
        """Number of drafted nodes (the root is not counted, as in the DDTree budget)."""
        return self.tokens.shape[0] - 1

    @property
    def is_chain(self) -> bool:
        n = self.tokens.shape[0]
        return bool(torch.equal(self.parents, torch.arange(-1, n - 1, device=self.parents.device)))

    def ancestor_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        # each node's ancestors as the bits of a Python int, its parent's with its own bit (parents
        # precede children), then unpacked at once: cheap even for hundreds of nodes, where a dozen
        # small tensor ops cost as much for any tree (docs/decisions.md, "tree masks and crops in a few
        # host calls")
        bits: list[int] = []
        for node, parent in enumerate(self.parents.tolist()):
            bits.append((bits[parent] if parent >= 0 else 0) | 1 << node)
        n, width = len(bits), (len(bits) + 7) // 8
        packed = np.frombuffer(b"".join(row.to_bytes(width, "little") for row in bits), dtype=np.uint8)
        mask = np.unpackbits(packed.reshape(n, width), axis=1, count=n, bitorder="little").view(np.bool_)
        return torch.from_numpy(mask).to(self.tokens.device)

    def position_ids(self, start: int) -> torch.Tensor:
        """Position of each node when the root sits at absolute position ``start``."""
        return self.depths + start

    def children(self) -> list[list[int]]:
        """children()[i] lists node i's children in index order (the builder's preference order)."""
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0])]
        for child, parent in enumerate(self.parents.tolist()[1:], start=1):
            kids[parent].append(child)
        return kids
