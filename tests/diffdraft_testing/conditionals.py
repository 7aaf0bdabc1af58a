"""Conditional draft distributions given as a table, for tree and verifier tests that need a drafter
whose positions depend on the token drafted before them without running a network."""

from __future__ import annotations

import torch

from diffdraft.drafters.conditional_proposal import ConditionalProposal
from diffdraft.drafters.conditionals import Conditionals


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
