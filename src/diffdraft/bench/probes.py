"""Probes that time what the engine's stages do not split: a module's forwards, an N-gram trie's lookups.

Hugging Face ``generate`` reports no rounds or stage times; hooks on the model itself see every
forward it makes, so its rounds get the same accounting of pure model time as the engine's stages
give diffdraft's methods. DART's tree building queries an N-gram trie; :class:`TimedNgram` wraps the
trie the benchmark hands the tree, so the lookups are timed apart from the tree search around them
and the library's own tree pays nothing for the counting.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from diffdraft.ngram import NgramTrie


@dataclass
class ForwardCall:
    cached: int
    """Tokens in the KV cache before the call (0 when the module takes no cache)."""
    tokens: int
    """Input positions processed by the call."""
    seconds: float


class ForwardProbe:
    """Records a :class:`ForwardCall` for each forward of ``module`` while the ``with`` block runs."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module
        self.calls: list[ForwardCall] = []
        self._handles: list = []
        self._begin = 0.0

    def __enter__(self) -> ForwardProbe:
        self.calls = []
        if self.module is not None:
            self._handles = [
                self.module.register_forward_pre_hook(self._before, with_kwargs=True),
                self.module.register_forward_hook(self._after, with_kwargs=True),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def seconds(self) -> float:
        return sum(call.seconds for call in self.calls)

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # "cache" since transformers 5.24
        cached = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
        first = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        tokens = int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() >= 2 else 0
        self.calls.append(ForwardCall(cached, tokens, 0.0))
        self._begin = time.perf_counter()

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        self.calls[-1].seconds = time.perf_counter() - self._begin


def rounds_from_calls(calls: list[ForwardCall], prompt_length: int, generated: int) -> list[int]:
    """Tokens each verification forward committed, recovered from the cache lengths the forwards saw.

    A forward that starts with ``cached`` tokens in the cache was fed the last committed token first,
    so ``cached + 1`` tokens were committed before it; the end state is prompt plus generated tokens.
    A pure prefill (exactly the prompt) is not a round; a prefill that also verified candidates (HF
    assisted generation does that) is one.
    """
    committed = [prompt_length if i == 0 else call.cached + 1 for i, call in enumerate(calls)]
    committed.append(prompt_length + generated)
    lengths = [after - before for before, after in itertools.pairwise(committed)]
    if calls and calls[0].tokens == prompt_length:
        lengths = lengths[1:]
    return [max(1, n) for n in lengths]


class TimedNgram:
    """An N-gram trie whose lookups (one context's candidates: one per beam entry and tree level)
    are timed.

    Drop-in for the trie of :class:`~diffdraft.trees.dart.DartTreeBuilder`; other attributes are the
    trie's. ``seconds`` holds one entry per lookup since the last :meth:`take`; a
    ``log_probs_many`` call (a whole beam's lookups at once) counts as that many lookups of equal
    share.
    """

    def __init__(self, trie: NgramTrie) -> None:
        self.trie = trie
        self.order = trie.order
        self.seconds: list[float] = []

    def log_probs(self, context: Sequence[int], tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        begin = time.perf_counter()
        scores = self.trie.log_probs(context, tokens)
        self.seconds.append(time.perf_counter() - begin)
        return scores

    def log_probs_many(
        self, contexts: Sequence[Sequence[int]], tokens: np.ndarray | Sequence[int]
    ) -> np.ndarray:
        begin = time.perf_counter()
        scores = self.trie.log_probs_many(contexts, tokens)
        share = (time.perf_counter() - begin) / max(1, len(contexts))
        self.seconds.extend([share] * len(contexts))
        return scores

    def take(self) -> list[float]:
        """The calls' seconds since the last take, and start counting afresh."""
        seconds, self.seconds = self.seconds, []
        return seconds

    def __getattr__(self, name: str) -> object:
        if name == "trie":  # not set yet (e.g. while copying): no endless recursion
            raise AttributeError(name)
        return getattr(self.trie, name)
