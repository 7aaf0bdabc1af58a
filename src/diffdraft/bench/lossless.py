"""The losslessness check: every method's greedy tokens against plain AR's, divergences explained.

In float32 the tokens must be identical. In bfloat16 / float16 a forward over many tokens rounds
differently from one-token decoding, so two exact methods can pick different tokens where the
target's top two logits nearly tie. Each divergence is therefore recomputed in float32 at its first
position: it is explained only if both tokens there are within a small tolerance of the float32
maximum. A divergence at a clear margin is a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

TIE_TOLERANCE = {torch.float64: 0.0, torch.float32: 0.0, torch.bfloat16: 0.5, torch.float16: 0.1}
"""Largest float32 logit gap a divergence may show and still count as rounding, per run dtype.

bfloat16: on SmolLM2-135M a bfloat16 run's top-2 logits sit well within this of float32's, and every
divergence seen had a smaller gap (docs/decisions.md, "a bfloat16 divergence within 0.5 counts as
rounding").
"""


@dataclass
class Divergence:
    position: int
    """Index of the first differing generated token."""
    reference_token: int | None
    """Plain AR's token there (None when its output ended first)."""
    method_token: int | None
    top1: int
    top2: int
    margin: float
    """float32 logit of the target's top-1 minus its top-2 token at that position."""
    gap: float
    """How far below the float32 maximum the lower of the two divergent tokens' logits lies."""
    explained: bool
    """True when the gap is within the tolerance: a numerical near-tie, not a bug."""

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """First index where the sequences differ (a length difference counts), or None if equal."""
    for index, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


class LosslessChecker:
    """Compares outputs and explains divergences with a float32 copy of the target (loaded on demand)."""

    def __init__(self, float32_model: Callable[[], PreTrainedModel], tolerance: float) -> None:
        self._load = float32_model
        self._model: PreTrainedModel | None = None
        self.tolerance = tolerance

    def check(self, prompt: list[int], reference: list[int], candidate: list[int]) -> Divergence | None:
        position = first_divergence(reference, candidate)
        if position is None:
            return None
        logits = self._float32_logits(prompt + reference[:position])
        top = logits.topk(2)
        ref_token = reference[position] if position < len(reference) else None
        new_token = candidate[position] if position < len(candidate) else None
        if ref_token is None or new_token is None:
            gap = float("inf")  # one output just stopped: no rounding explains that
        else:
            gap = float(top.values[0] - logits[[ref_token, new_token]].min())
        return Divergence(
            position=position,
            reference_token=ref_token,
            method_token=new_token,
            top1=int(top.indices[0]),
            top2=int(top.indices[1]),
            margin=float(top.values[0] - top.values[1]),
            gap=gap,
            explained=gap <= self.tolerance,
        )

    @torch.inference_mode()
    def _float32_logits(self, ids: list[int]) -> torch.Tensor:
        if self._model is None:
            self._model = self._load()
        tokens = torch.tensor([ids], device=self._model.device)
        return self._model(input_ids=tokens, logits_to_keep=1).logits[0, -1].float()
