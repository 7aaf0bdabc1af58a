"""The progressive position-weighted cross-entropy of DFlare (Eq. 5).

Position k of a block is weighted by exp(-(k - 1) / gamma): an early mistake voids the rest of the
block, so early positions matter most. gamma grows linearly from gamma_0 to gamma_max over
training, shifting effort from the easy first positions to the harder tail.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from diffdraft.train.blocks import IGNORE


def gamma_at(step: int, total_steps: int, gamma_0: float, gamma_max: float) -> float:
    return gamma_0 + (step / max(total_steps, 1)) * (gamma_max - gamma_0)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights; position 0 (the anchor) has no label and gets weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, block_positions: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted mean CE over labelled rows, plus per-position top-1 hits and counts [B].

    Only labelled rows are passed (``logits`` [r, V], ``labels`` [r], ``block_positions`` [r] in
    1..B-1): the LM head over anchors and past-the-end rows would be wasted work. A label of
    ``IGNORE`` (a token outside the draft vocabulary) adds no loss but counts as a miss.
    """
    ce = F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=IGNORE)
    weights = position_weights(block_size, gamma).to(logits.device)[block_positions]
    weights = weights * (labels != IGNORE)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-8)
    hits = torch.zeros(block_size, device=logits.device).index_add_(
        0, block_positions, (logits.argmax(-1) == labels).float()
    )
    counts = torch.zeros(block_size, device=logits.device).index_add_(
        0, block_positions, torch.ones_like(labels, dtype=torch.float)
    )
    return loss, hits, counts
