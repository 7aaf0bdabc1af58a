"""What a benchmark method is given and gives back: the values every runner shares.

Kept apart from the registry in :mod:`diffdraft.bench.methods` so runners of other engines
(:mod:`diffdraft.bench.llamacpp`) depend on these values, not on the registry that builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.target.loading import DTYPES

STAGE_NAMES = (
    "prefill",
    "draft",
    "ngram",
    "tree",
    "mask",
    "verify_forward",
    "accept",
    "commit",
    "other",
)
"""Per-generation time split; ``other`` is everything outside the engine's stages. ``ngram`` is the
DART tree's N-gram lookups (0 for every other method), ``tree`` the tree building without them."""


class MethodUnavailable(InvalidRequestError):
    """The method cannot run with what was given (e.g. no drafter); default method lists skip it."""


@dataclass(frozen=True)
class MethodSpec:
    name: str
    arg: str | None = None
    dtype: str | None = None
    """None: the benchmark's dtype."""

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        rest, _, dtype = text.strip().partition("@")
        name, _, arg = rest.partition(":")
        if not name or (dtype and dtype not in DTYPES):
            raise InvalidRequestError(
                f"bad method spec {text!r}: write name[:arg][@dtype], e.g. ddtree:32, hf-pld:3 or hf@float32 "
                f"(dtype one of {', '.join(DTYPES)})"
            )
        return cls(name, arg or None, dtype or None)

    @property
    def label(self) -> str:
        return self.name + (f":{self.arg}" if self.arg else "") + (f"@{self.dtype}" if self.dtype else "")


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class Completion:
    token_ids: list[int]
    seconds: float
    """Wall time of the whole call, prefill included."""
    acceptance_lengths: list[int]
    """Tokens committed per verification round, bonus included."""
    stages: dict[str, float]
    """Seconds per stage (see :data:`STAGE_NAMES`) over the whole generation."""
    verify_sizes: list[int] = field(default_factory=list)
    """Tokens in each round's verification forward."""
    verify_seconds: list[float] = field(default_factory=list)
    """Seconds of each round's verification forward."""
    verify_contexts: list[int] = field(default_factory=list)
    """Cached tokens each round's verification forward attended over."""
    budgets: list[int] = field(default_factory=list)
    """DDTree budget of each round (auto budget only)."""
    draft_depths: list[int] = field(default_factory=list)
    """Positions drafted in each round (one entry per acceptance length)."""
    ngram_lookups: int = 0
    """N-gram trie lookups (``log_probs`` calls) the tree made over the generation."""
    ngram_lookup_median: float = 0.0
    """Median seconds of one of those lookups."""
    engine: str = "diffdraft"
    """What ran the target's forwards: ``diffdraft`` (our kernels and loop), ``transformers`` or
    ``llama.cpp``. The physical bound is built from our kernels' cost curve, so only ours get one."""


class MethodRunner(Protocol):
    """Generates one request and accounts for where the time went."""

    spec: MethodSpec
    dtype: torch.dtype | None
    """The target's dtype this runner computes in; None for another engine's weights (llama.cpp), whose
    greedy tokens are not checked against plain AR's."""

    def generate(self, request: Request) -> Completion: ...
