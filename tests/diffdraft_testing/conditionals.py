"""Conditional draft distributions given as a table, for tree and verifier tests that need a drafter
whose positions depend on the token drafted before them without running a network."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from diffdraft.drafters.conditional_proposal import ConditionalProposal
from diffdraft.drafters.conditionals import Conditionals
from diffdraft.trees import DraftTree

from diffdraft_testing.trees import prefixes


class TableConditionals(Conditionals):
    """``table[l, p]``: the log-probabilities [width] of position ``l`` after target token ``p``;
    column ``j`` is token ``vocab[j]`` (None: token ``j``)."""

    def __init__(self, table: torch.Tensor, vocab: torch.Tensor | None = None) -> None:
        self.table, self.vocab, self.width = table.float(), vocab, int(table.shape[2])

    @property
    def depth(self) -> int:
        return int(self.table.shape[0])

    @property
    def device(self) -> torch.device:
        return self.table.device

    def rows(self, position: int, previous: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.table[position, previous], None


def table_proposal(
    table: torch.Tensor, root: int, vocab: torch.Tensor | None = None, vocab_size: int | None = None
) -> ConditionalProposal:
    """The proposal of ``table`` (:class:`TableConditionals`) after ``root``, over ``vocab_size``
    tokens (None: the table's previous-token axis)."""
    size = int(table.shape[1]) if vocab_size is None else vocab_size
    return ConditionalProposal(TableConditionals(table, vocab), torch.tensor([root]), size)


def random_table(depth: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """[depth, vocab, vocab] log-probabilities: each position's row after each previous token, drawn
    far apart, so that a token's successors depend on it."""
    logits = scale * torch.randn(depth, vocab, vocab, generator=torch.Generator().manual_seed(seed))
    return logits.log_softmax(-1)


def joint_scores(prefix: tuple[int, ...], table: torch.Tensor, root: int) -> float:
    """The log-probability of ``prefix`` under the table's chain rule, after ``root`` (whole-vocabulary
    tables: column = token), summed in path order as a tree builder sums it."""
    total, previous = 0.0, root
    for position, token in enumerate(prefix):
        total += float(table[position, previous, token])
        previous = token
    return total


def assert_top_prefixes(
    tree: DraftTree,
    scores: list[float],
    row: Callable[[int, int], dict[int, float]],
    root: int,
    depth: int,
    budget: int,
) -> None:
    """``tree`` with its ``ranked`` ``scores`` is the ``budget`` likeliest paths of up to ``depth``
    tokens after ``root`` under the chain rule of ``row(position, previous)`` ({token: log-probability}
    over the row's support, computed apart from the code under test), enumerated by brute force; only
    a node's top ``budget`` successors can be in the tree, so the enumeration follows those only."""
    brute: dict[tuple[int, ...], float] = {}
    frontier = [((), 0.0, root)]
    for position in range(depth):
        grown = []
        for prefix, total, previous in frontier:
            ranked = sorted(row(position, previous).items(), key=lambda item: -item[1])[:budget]
            for token, log_prob in ranked:
                grown.append(((*prefix, token), total + log_prob, token))
        brute.update((prefix, total) for prefix, total, _ in grown)
        frontier = grown
    nodes = prefixes(tree)
    assert tree.num_nodes == budget and len(set(nodes)) == budget
    assert scores[1:] == pytest.approx([brute[p] for p in nodes], abs=1e-5)
    best = sorted(brute.values(), reverse=True)
    assert sorted(scores[1:], reverse=True) == pytest.approx(best[:budget], abs=1e-5)
