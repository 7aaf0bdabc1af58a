"""N-gram stand-ins with the trie's lookup interface."""

from __future__ import annotations

import numpy as np


class PerContextLookups:
    """``log_probs_many`` for N-gram test doubles that define ``log_probs`` (one context) only."""

    def log_probs_many(self, contexts, tokens):
        return np.stack([self.log_probs(context, tokens) for context in contexts]).reshape(len(contexts), -1)


class TrigramTable(PerContextLookups):
    """An N-gram stand-in with the trie's interface, random but fixed per context."""

    order = 3

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def log_probs(self, context, tokens) -> np.ndarray:
        key = hash((self.seed, *context[-2:])) % 2**32
        table = np.log(np.random.default_rng(key).dirichlet(np.full(self.vocab, 0.5)) + 1e-30)
        return table[np.asarray(tokens)].astype(np.float32)
