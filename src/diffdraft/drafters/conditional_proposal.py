"""A proposal whose positions depend on the token drafted before them
(:mod:`~diffdraft.drafters.conditionals`).

Tree builders that can follow the dependence read :attr:`ConditionalProposal.conditionals` and ask
for each drafted token's own successor distribution. Every other consumer reads the rows a
:class:`~diffdraft.drafters.base.Proposal` has, the greedy chain's (:meth:`Conditionals.greedy_rows`):
they are written out the first time one is read, so a round whose builder walks the conditionals
never pays for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.drafters.conditionals import Conditionals


class ConditionalProposal(Proposal):
    """A :class:`Proposal` drafted from :class:`Conditionals` after ``root`` (the anchor, a token id
    tensor on the drafter's device, so that reading it waits for nothing), of the rows' first
    ``depth`` positions (None: all of them; a batch's rows are drafted to the deepest).
    ``vocab_size`` and ``columns`` are :meth:`Proposal.restricted`'s."""

    def __init__(
        self,
        conditionals: Conditionals,
        root: torch.Tensor,
        vocab_size: int,
        columns: Mapping[int, int] | None = None,
        depth: int | None = None,
    ) -> None:
        super().__init__()
        self._depth = conditionals.depth if depth is None else min(depth, conditionals.depth)
        self._conditionals: Conditionals | None = conditionals
        self._source = conditionals
        self._root = root.reshape(1)
        self._vocab_size = vocab_size
        self._columns = columns
        self._walked = False

    @property
    def conditionals(self) -> Conditionals | None:
        """The per-predecessor rows; None once :meth:`scores_of` handed the greedy rows out to be
        changed (a mixed-in copy): from then on those rows are the proposal."""
        return self._conditionals

    def _walk(self) -> None:
        """Write out the greedy chain's rows, in :meth:`Proposal.restricted`'s layout."""
        if self._walked:
            return
        self._walked = True
        rows = self._source.greedy_rows(self._root, self._depth)
        if self._source.vocab is None:
            self._log_probs = rows
        else:
            self._scored, self._vocab = rows, self._source.vocab

    def log_probs_after(self, position: int, previous: torch.Tensor) -> torch.Tensor:
        """The conditional rows over the whole vocabulary (the greedy rows' once :meth:`scores_of`
        handed those out)."""
        if self._conditionals is None:
            return super().log_probs_after(position, previous)
        log_probs, ids = self._source.full_rows(position, previous)
        if self._source.vocab is None:
            return log_probs
        full = log_probs.new_full((log_probs.shape[0], self._vocab_size), float("-inf"))
        return full.index_copy_(1, ids, log_probs)

    def scores_of(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self._walk()
        self._conditionals = None
        return super().scores_of(token_ids)

    def extended(self, rows: int) -> Proposal:
        """The greedy rows, extended: a proposal of independent positions."""
        self._walk()
        return super().extended(rows)

    @property
    def log_probs(self) -> torch.Tensor | None:
        self._walk()
        return super().log_probs

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._walk()
        return super().top(k)

    @property
    def has_distributions(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self._source.device

    @property
    def depth(self) -> int:
        return self._depth
