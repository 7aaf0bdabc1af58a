"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Costs no model at all; strong on inputs that repeat themselves (code edits, summaries, RAG).
"""

from __future__ import annotations

import torch

from diffdraft.drafters.base import ForksByCopy, Proposal


class PromptLookupDrafter(ForksByCopy):
    target_layer_ids: list[int] = []  # noqa: RUF012  (part of the Drafter protocol; never mutated)

    def __init__(self, max_depth: int = 10, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_depth = max_depth
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []
        """The tokens :meth:`match` indexed: a generation's context only grows, anything else starts
        the index over."""
        self._latest: dict[tuple[int, ...], int] = {}
        """Every n-gram of :attr:`_seen` but its last token's: where its latest occurrence ends."""

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        _, follow = self.match(token_ids.tolist(), depth)
        return Proposal(tokens=torch.tensor(follow, dtype=torch.long))

    def match(self, ids: list[int], depth: int) -> tuple[int, list[int]]:
        """(n, up to ``depth`` tokens that followed the latest earlier occurrence of the last n-gram),
        longest n first; (0, []) without a match. Each n-gram is indexed once, as the context grows
        past it: a lone sequence's round plan asks for its copy every round, and a scan of the whole
        context each time grew with the context (docs/decisions.md, "prompt lookup indexes each n-gram
        once")."""
        seen = self._seen
        if len(ids) < len(seen) or ids[: len(seen)] != seen:
            seen = self._seen = []
            self._latest = {}
        latest = self._latest
        for end in range(max(0, len(seen) - 1), len(ids) - 1):  # n-grams ending before the last token
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                latest[tuple(ids[end - n + 1 : end + 1])] = end
        seen.extend(ids[len(seen) :])
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            end = latest.get(tuple(ids[-n:]))
            if end is not None:
                return n, ids[end + 1 : end + 1 + depth]
        return 0, []
