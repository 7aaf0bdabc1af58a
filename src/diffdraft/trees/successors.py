"""Each drafted token's successors, ranked: what DDTree's best-first heap expands a node by.

Independent positions (DFlash, DFlare, DART, DEER) rank one list per depth, shared by every node
there (:class:`DepthRanks`). Where a position's distribution depends on the token drafted before it
(DSpark, DFlash2: :class:`~diffdraft.drafters.conditionals.Conditionals`), a node's successors are
ranked by its own conditional row (:class:`ConditionalRanks`), computed when the heap first needs
them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffdraft.drafters.conditionals import Conditionals
from diffdraft.kernels.quantized.row_topk import top_rows

SIBLINGS_AT_ONCE = 8
"""Conditional rows computed in one call: the row a node needs and those of its next siblings, which
the heap tends to expand soon after it (one call per row pays a dispatch and a device-to-host copy
for a rank-r product)."""

Ranked = tuple[list[float], list[int]]
"""(log-probabilities, token ids) of a node's likeliest successors, most likely first."""


class SuccessorRanks(Protocol):
    def successors(self, depth: int, siblings: list[int], rank: int, room: int) -> Ranked:
        """The ranked successors, at most ``room`` of them, of a node at ``depth`` (0: the root) that
        carries ``siblings[rank]``: ``siblings`` are its parent's ranked children, and those after it
        are the nodes the builder is likely to expand next."""
        ...


class DepthRanks:
    """One ranked list per depth (the proposal's top-k), whatever token precedes it."""

    def __init__(self, scores: list[list[float]], tokens: list[list[int]]) -> None:
        self.scores, self.tokens = scores, tokens

    def successors(self, depth: int, siblings: list[int], rank: int, room: int) -> Ranked:
        return self.scores[depth], self.tokens[depth]


class ConditionalRanks:
    """Each node's successors ranked by the conditional row after its own token. A row depends on
    the position and the previous token only, so nodes that share both share it."""

    def __init__(self, conditionals: Conditionals) -> None:
        self.conditionals = conditionals
        self._rows: dict[tuple[int, int], Ranked] = {}

    def successors(self, depth: int, siblings: list[int], rank: int, room: int) -> Ranked:
        key = (depth, siblings[rank])
        if key not in self._rows:
            nearby = siblings[rank : rank + min(SIBLINGS_AT_ONCE, room)]  # more could never all join
            self._rank(depth, [token for token in nearby if (depth, token) not in self._rows], room)
        return self._rows[key]

    def _rank(self, depth: int, previous: list[int], room: int) -> None:
        """Rank the successors of each token in ``previous`` at ``depth``, ``room`` at most."""
        device = self.conditionals.device
        log_probs, columns = self.conditionals.rows(depth, torch.tensor(previous, device=device))
        values, picked = top_rows(log_probs, min(room, log_probs.shape[1]))
        ids = self.conditionals.token_ids(picked if columns is None else columns[picked])
        for token, scores, tokens in zip(previous, values.cpu().tolist(), ids.cpu().tolist(), strict=True):
            self._rows[(depth, token)] = (scores, tokens)
