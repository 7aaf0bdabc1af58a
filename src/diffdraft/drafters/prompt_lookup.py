"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Costs no model at all; strong on inputs that repeat themselves (code edits, summaries, RAG). On a
CPU every verified token costs the forward a share of a plain one, so a round that verified a whole
10-token copy to keep two of them cost more than it gained, and ``pld`` ran at half plain decoding's
speed on 0.5-1.5 B models (issue 85). Given what verifying costs here, a copy is cut to the length
that buys the most expected tokens per second of verification: each copy token is kept with the
generation's own calibrated rate for its match and depth
(:class:`~diffdraft.drafters.copy_calibration.CopyCalibration`), and a copy that would not pay is
not verified at all (a plain round).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from diffdraft.drafters.base import ForksByCopy, Proposal
from diffdraft.drafters.copy_calibration import CopyCalibration

VerifySeconds = Callable[[np.ndarray, float], np.ndarray]
"""Seconds of verifying each of an array of token counts (the pending token included) over a given
number of cached tokens: the auto budget's cost curve is one."""


class PromptLookupDrafter(ForksByCopy):
    target_layer_ids: list[int] = []  # noqa: RUF012  (part of the Drafter protocol; never mutated)

    def __init__(
        self,
        max_depth: int = 10,
        max_ngram: int = 3,
        min_ngram: int = 1,
        verify_seconds: VerifySeconds | None = None,
    ) -> None:
        """``verify_seconds``: what verifying costs on this machine, to size each copy by (None: every
        copy whole, as a drafter that mixes copies into its own proposal takes them)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_depth = max_depth
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.verify_seconds = verify_seconds
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []
        """The tokens :meth:`match` indexed: a generation's context only grows, anything else starts
        the index over."""
        self._latest: dict[tuple[int, ...], int] = {}
        """Every n-gram of :attr:`_seen` but its last token's: where its latest occurrence ends."""
        self.calibration = (
            CopyCalibration((self.max_ngram + 1, self.max_depth)) if self.verify_seconds is not None else None
        )
        """How this generation's copies fared, to size the next ones by (None: copies go whole)."""

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        ids = token_ids.tolist()
        ngram, follow = self.match(ids, depth)
        if self.calibration is not None:
            self.calibration.score(ids)
            follow = follow[: self.max_depth]
            # scored whole next round: where the cut copy is all kept, the bonus token checks one more
            self.calibration.copied(len(ids) - 1, ngram, follow)
            follow = follow[: self.paying_length(ngram, len(follow), len(ids))]
        return Proposal(tokens=torch.tensor(follow, dtype=torch.long))

    def paying_length(self, ngram: int, length: int, context: int) -> int:
        """How many of a ``length``-token copy after an ``ngram`` match to verify over ``context``
        cached tokens: the most expected tokens per second of verification (the fewest among equals;
        0: none, a plain round)."""
        if not length:
            return 0
        expected = np.asarray(self.calibration.expected(ngram, length))
        seconds = self.verify_seconds(np.arange(1, length + 2), context)
        return int(np.argmax(expected / seconds))

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
