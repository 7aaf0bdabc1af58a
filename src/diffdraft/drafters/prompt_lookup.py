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

    def reset(self) -> None:
        pass

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        _, follow = self.match(token_ids.tolist(), depth)
        return Proposal(tokens=torch.tensor(follow, dtype=torch.long))

    def match(self, ids: list[int], depth: int) -> tuple[int, list[int]]:
        """(n, up to ``depth`` tokens that followed the latest earlier occurrence of the last n-gram),
        longest n first; (0, []) without a match."""
        last = ids[-1]
        # every earlier occurrence ends on the last token, so one pass finds all candidates, latest
        # first (recent text predicts best): far cheaper than comparing a window at every position
        # (figures: benchmarks/README.md, 'Measurements behind the code')
        ends = [i for i in range(len(ids) - 2, -1, -1) if ids[i] == last]
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            suffix = ids[-n:]
            for end in ends:
                if end >= n - 1 and ids[end - n + 1 : end + 1] == suffix:
                    return n, ids[end + 1 : end + 1 + depth]
        return 0, []
