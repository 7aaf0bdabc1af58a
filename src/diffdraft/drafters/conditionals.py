"""Draft distributions that depend on the token drafted just before: one row per predecessor.

DSpark's Markov head and DFlash2's candidate selector score position ``l`` given the token chosen at
``l - 1`` (the anchor at position 0). Their forward computes what every predecessor shares once per
position (DSpark's head logits, DFlash2's candidates, unary scores and projected state); the part a
predecessor adds is a rank-r term, cheap enough to compute for whichever predecessors a tree builder
or a sampled chain meets. :class:`Conditionals` is that pair: the shared part, and :meth:`rows`,
which adds a predecessor's term on demand. The drafter's joint distribution over a drafted path is
the product of its rows along it (chain rule), which is what a tree over it should rank paths by.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Conditionals(ABC):
    """One proposal's per-position distributions given the previous token.

    Rows are over the drafter's columns: column ``j`` is token ``vocab[j]`` (``vocab`` None: token
    ``j``), ``width`` columns in all; a row may cover a few of them only (:meth:`rows` says which),
    every other column then at probability 0.
    """

    vocab: torch.Tensor | None
    """The token id of each column; None: column ``j`` is token ``j``."""
    width: int
    """How many columns there are (the draft vocabulary's size, or the whole vocabulary's)."""

    @property
    @abstractmethod
    def depth(self) -> int:
        """How many positions after the root the rows cover."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the rows are computed."""

    @abstractmethod
    def rows(self, position: int, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probabilities [n, w] float32, their columns [w]) of position ``position`` (0: the first
        after the root) after each of the ``previous`` [n] target token ids; columns None: all
        ``width`` columns in order. Each row sums to 1 over its columns."""

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The target token ids of ``columns``."""
        return columns if self.vocab is None else self.vocab[columns]

    @torch.inference_mode()
    def full_rows(self, position: int, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rows` over all ``width`` columns (-inf where a row does not reach), and the columns'
        target token ids: rows any consumer of whole distributions can read."""
        log_probs, columns = self.rows(position, previous)
        if columns is not None:
            full = log_probs.new_full((log_probs.shape[0], self.width), float("-inf"))
            log_probs = full.index_copy_(1, columns, log_probs)
        ids = torch.arange(self.width, device=log_probs.device) if self.vocab is None else self.vocab
        return log_probs, ids

    @torch.inference_mode()
    def greedy_rows(self, root: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """[depth, width] log-probabilities along the greedy chain: position ``l``'s row after the
        argmax of position ``l - 1``'s (position 0's after ``root``, a [1] token id), for the first
        ``depth`` positions (None: all). What greedy drafting and vLLM's temperature-0 walk read, and
        the marginals diffdraft gives consumers that take positions to be independent."""
        previous, rows = root.reshape(1), []
        for position in range(self.depth if depth is None else depth):
            row, _ = self.full_rows(position, previous)
            rows.append(row[0])
            previous = self.token_ids(row.argmax(-1))
        if not rows:
            return torch.empty((0, self.width), device=root.device)
        return torch.stack(rows)
