"""Sampling parameters and the one place that turns logits into the distribution we sample from.

Every component that needs "the target's distribution" (verifiers, drafters sampling their own
proposals, tests) calls :meth:`SamplingParams.probs`, so the warping (temperature, top-k, top-p)
is defined exactly once and speculative decoding reproduces plain sampling exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffdraft.errors import InvalidRequestError

MIN_TEMPERATURE = 1e-2
"""The smallest temperature above 0 a request may ask for. Logits are divided by the temperature in
float32, where a temperature under about 1e-38 rounds to 0 and ones not much larger overflow the
scores of ordinary logits: 1e-300 gave inf and nan scores, and sampling failed with a traceback. The
bound sits far above that edge because nothing is lost by it: at 1e-2 a token whose logit trails
the best by 0.5 is already e^-50 (about 2e-22) times as likely, greedy in all but name, and
temperature 0 is greedy exactly. vLLM raises smaller temperatures to the same 1e-2."""


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise an :class:`InvalidRequestError` naming the first bad sampling parameter and what it
    must be. The one check of every entry point (library requests, ``diffdraft generate`` before it
    loads anything, the server): :class:`SamplingParams` runs it when made."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or math.isnan(temperature):
        raise InvalidRequestError(f"temperature must be a number, got {temperature!r}")
    if temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not math.isfinite(temperature):
        raise InvalidRequestError(f"temperature must be finite, got {temperature}; try 1.0")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature {temperature:g} is too small to sample with: use 0 for greedy decoding (what "
            f"tiny temperatures approach) or at least {MIN_TEMPERATURE:g}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks a token. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities over the last dimension, in float32.

        Greedy parameters give a one-hot distribution on the argmax, so callers that only know
        distributions (rejection sampling) stay correct at temperature 0 too.
        """
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
        scores = logits / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth_best = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth_best, float("-inf"))
        probs = scores.softmax(-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(-1, descending=True)
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension ([..., V] -> [...]), first index on ties.

    Plain decoding and every verifier pick greedy tokens here, so they break ties alike. ``max``
    returns the same index as ``argmax``, faster on CPU bfloat16 logits, where ``argmax`` over a
    tree's rows was a visible part of each round (docs/decisions.md, "greedy tokens by max, not
    argmax").
    """
    return logits.max(-1).indices


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of ``probs`` ([..., V] -> [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
