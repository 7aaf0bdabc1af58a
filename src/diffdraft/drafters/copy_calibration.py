"""How often the target keeps a copied continuation's tokens, per matched n-gram length and depth.

Prompt lookup copies what followed the latest earlier occurrence of the context's last n-gram. How
much of such a copy the target keeps depends on the match (1-gram matches are weak evidence, 3-gram
ones strong) and on the depth (each token is kept only once the ones before it were). A generation's
own copies say how that goes on its text: the calibration compares each copy with what the target
emitted after it, up to its first miss, and estimates w_d, the probability that copy token d is kept
once the ones before it were, starting from a prior (1/2, or a drafter's :class:`CopyRecord`).
``ddtree+pld`` mixes its copies into the drafter's marginals with these weights, and ``pld`` sizes
its copies by them (docs/decisions.md, "copy weights calibrated per n-gram and depth").
"""

from __future__ import annotations

import numpy as np

PRIOR_COPIES = 2
"""How many copies a generation's calibration counts its starting rate as, before its own evidence."""


class CopyRecord:
    """What the target kept of the copies of every generation a drafter and its forks drafted, per
    matched n-gram length and depth: where a generation's calibration starts. A fixed 1/2 misjudged
    both ends: on the bench's prompts the default target kept the first token of a 3-gram match's
    copy most of the time and of a 1-gram match's seldom, and an auto budget that starts each
    generation from the record copies more and drafts less at batch 1 (docs/decisions.md, "copy
    calibration starts from the drafter's record"). Each (n, d) keeps about its latest ``window``
    checks: half of them are forgotten once the window is full, so the record follows what the
    drafter is now asked to continue."""

    def __init__(self, shape: tuple[int, int], window: int = 256) -> None:
        self.confirmed = np.zeros(shape, dtype=np.float32)
        self.checked = np.zeros(shape, dtype=np.float32)
        self.window = window

    def add(self, ngram: int, depth: int, kept: bool) -> None:
        """One copied token checked against what the target emitted (depth from 0)."""
        if self.checked[ngram, depth] >= self.window:
            self.checked[ngram, depth] /= 2
            self.confirmed[ngram, depth] /= 2
        self.checked[ngram, depth] += 1
        self.confirmed[ngram, depth] += kept

    def rates(self) -> np.ndarray:
        """The share kept per (n, d), 1/2 where nothing was checked: (confirmed + 1) / (checked + 2)."""
        return ((self.confirmed + 1) / (self.checked + 2)).astype(np.float64)


class CopyCalibration:
    """One generation's copy weights w_d per (n-gram length, depth) (:meth:`weights`), learned from its
    copies as the target confirms or refutes them (:meth:`score`), and what a copy of each length is
    expected to add (:meth:`expected`). ``shape``: (longest n-gram + 1, deepest copy); ``weight``: a
    fixed w for every depth instead of learning; ``record``: where each generation starts and what
    its copies teach across generations (None: each starts from 1/2, so a seeded request's output
    never depends on the requests before it)."""

    def __init__(
        self, shape: tuple[int, int], weight: float | None = None, record: CopyRecord | None = None
    ) -> None:
        self.shape = shape
        self.weight = weight
        self.record = record
        self.reset()

    def reset(self) -> None:
        """A new generation: its own counts, its prior read from the record once (so its weights move
        only with its own copies, and the expectations cached below stay valid until one is scored)."""
        # numpy, not torch: read and counted every round, and a torch op on a few numbers costs more;
        # [n, d]: copies after an n-gram match the target emitted, and those whose position it has
        self._confirmed = np.zeros(self.shape, dtype=np.float32)
        self._checked = np.zeros(self.shape, dtype=np.float32)
        self._prior = self.record.rates() if self.record is not None else np.full(self.shape, 0.5)
        self._last_copy: tuple[int, int, list[int]] = (0, 0, [])  # root index, n, copied tokens
        self.scorings = 0
        """Copies scored so far: the calibration's version."""
        self._expectations: tuple[int, dict[tuple[int, int], list[float]]] = (0, {})
        """The calibration's version and each copy's expectation under it, by (n-gram, copied length)."""

    def weights(self, ngram: int | slice, depth: int) -> np.ndarray:
        """w_d for depths 1..depth after an ``ngram`` match: fixed, or (confirmed + 2 p) / (checked + 2)
        with p the prior when the generation began (:data:`PRIOR_COPIES`); [depth], or
        [n-gram lengths, depth] for a slice of them."""
        confirmed, checked = self._confirmed[ngram, :depth], self._checked[ngram, :depth]
        if self.weight is not None:
            return np.full(confirmed.shape, self.weight)
        prior = self._prior[ngram, :depth]
        return (confirmed + PRIOR_COPIES * prior) / (checked + PRIOR_COPIES)

    def copied(self, root: int, ngram: int, tokens: list[int]) -> None:
        """The copy this round verifies (or mixes in): ``tokens`` after an ``ngram`` match, following
        the token at index ``root``; the next :meth:`score` compares it with what the target emitted."""
        self._last_copy = (root, ngram, tokens)

    def score(self, token_ids: list[int]) -> None:
        """Compare the last copy with what the target emitted since, up to its first miss."""
        root, ngram, copied = self._last_copy
        emitted = token_ids[root + 1 :]
        self.scorings += bool(copied and emitted)
        for d, (guess, actual) in enumerate(zip(copied, emitted, strict=False)):
            kept = guess == actual
            if self.record is not None:
                self.record.add(ngram, d, kept)
            self._checked[ngram, d] += 1
            if not kept:
                return
            self._confirmed[ngram, d] += 1

    def expected(self, ngram: int, length: int) -> list[float]:
        """The expected acceptance length (the bonus token included) of the first 0..``length`` tokens
        of a copy after an ``ngram`` match: the target keeps copy token d with probability w_d once it
        kept the ones before, so the first k add w_1 + w_1 w_2 + ... + w_1 ... w_k. The same list
        object while no copy was scored since, so a round plan that compares copies by identity reuses
        its answer, and numpy is asked only when the calibration moved (its dozen small ops were a
        visible share of a lone plain round, asked every round a copy is offered; docs/decisions.md,
        "an offer's expectations kept until a copy is scored")."""
        if self._expectations[0] != self.scorings:
            self._expectations = (self.scorings, {})
        table = self._expectations[1]
        expected = table.get((ngram, length))
        if expected is None:
            kept = self.weights(ngram, length).cumprod()
            expected = table[ngram, length] = [1.0, *(1.0 + kept.cumsum()).tolist()]
        return expected
