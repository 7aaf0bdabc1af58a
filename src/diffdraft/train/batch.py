"""A micro-batch of training sequences, right-padded so the target and the drafter see it in one
forward each.

One forward per sequence leaves a GPU idle: a 135M target over ~500 tokens is a few milliseconds of
tiny kernels, and a lent H100 trained at ~27 ms per sequence that way. Right padding is safe for
the target (causal attention: no real position sees the padding after it); the drafter's objective
masks the padding out itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PAD = 0
"""Token id of the padding after a sequence's end (any id would do: nothing real attends to it)."""


@dataclass
class SequenceInputs:
    """One sequence's share of a batch: the per-sequence objectives' arguments."""

    token_ids: torch.Tensor
    """[n]"""
    anchors: torch.Tensor
    taps: torch.Tensor | None
    """[n, T, H]"""
    target_logits: torch.Tensor | None
    """[n, V]"""
    response_start: int


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

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> SequenceInputs:
        n = self.lengths[i]
        return SequenceInputs(
            self.token_ids[i, :n],
            self.anchors[i],
            None if self.taps is None else self.taps[i, :n],
            None if self.target_logits is None else self.target_logits[i, :n],
            self.response_starts[i],
        )


def pad_right(sequences: list[torch.Tensor], value: float = PAD) -> torch.Tensor:
    """[b, L, ...] from tensors [n_i, ...], each followed by ``value`` up to the longest."""
    return nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=value)


class PerSequenceObjective(nn.Module):
    """An objective whose drafter forward takes one sequence at a time: a batch is a loop over it.

    Subclasses define ``sequence_loss(token_ids, anchors, taps, gamma, target_logits,
    response_start) -> (loss, hits, agreements, counts)``. The batch's loss is the mean of the
    sequences' losses, as a batched objective's is; the per-position statistics are summed.
    """

    def forward(
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        results = []
        for i in range(len(batch)):
            s = batch.sequence(i)
            results.append(
                self.sequence_loss(s.token_ids, s.anchors, s.taps, gamma, s.target_logits, s.response_start)
            )
        loss = torch.stack([r[0] for r in results]).mean()
        hits, agreements, counts = (torch.stack([r[k] for r in results]).sum(0) for k in (1, 2, 3))
        return loss, hits, agreements, counts
