"""A micro-batch of training sequences, right-padded so the target and the drafter see it in one
forward each.

One forward per sequence leaves a GPU idle: a 135M target over a few hundred tokens is a short run
of tiny kernels, so training one sequence at a time is launch-bound (docs/decisions.md,
"micro-batches for GPUs, 1 on a CPU"). Right padding is safe for the target (causal attention: no real
position sees the padding after it); the drafter's objective masks the padding out itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PAD = 0
"""Token id of the padding after a sequence's end (any id would do: nothing real attends to it)."""


@dataclass
class TrainingBatch:
    token_ids: torch.Tensor
    """[b, L] sequences right-padded with :data:`PAD` to the longest."""
    lengths: list[int]
    anchors: list[torch.Tensor]
    """Per sequence, sorted positions (:func:`~diffdraft.train.blocks.sample_anchors`)."""
    response_starts: list[int]
    taps: torch.Tensor | None = None
    """[b, L, T, H] the target's tapped layers (None for a drafter that taps nothing)."""
    target_logits: torch.Tensor | None = None
    """[b, L, V] the target's next-token logits (None: train on the tokens)."""


def pad_right(sequences: list[torch.Tensor], value: float = PAD) -> torch.Tensor:
    """[b, L, ...] from tensors [n_i, ...], each followed by ``value`` up to the longest."""
    return nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=value)


def pad_square_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """[b, Q, Q] bool from per-sequence visibility masks [q_i, q_i], Q the largest. A padding row
    sees only itself: a row that sees nothing would turn its attention into NaN."""
    size = max(mask.shape[0] for mask in masks)
    padded = torch.eye(size, dtype=torch.bool).repeat(len(masks), 1, 1)
    for out, mask in zip(padded, masks, strict=True):
        out[: mask.shape[0], : mask.shape[0]] = mask
    return padded
