"""Micro-batches: right padding, each sequence's share, and the per-sequence objectives' reduction."""

from __future__ import annotations

import torch

from diffdraft.train.batch import PAD, PerSequenceObjective, TrainingBatch, pad_right


def test_padding_goes_after_each_sequence_up_to_the_longest():
    padded = pad_right([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert padded.tolist() == [[5, 6, 7], [8, PAD, PAD]]
    features = pad_right([torch.ones(2, 3), torch.ones(1, 3)])
    assert features.shape == (2, 2, 3) and features[1, 1].eq(0).all()


def test_a_sequence_of_a_batch_is_its_own_rows_without_padding():
    token_ids = pad_right([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])])
    taps, logits = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 11)
    batch = TrainingBatch(token_ids, [4, 2], [torch.tensor([1]), torch.tensor([0])], [2, 1], taps, logits)
    second = batch.sequence(1)
    assert second.token_ids.tolist() == [5, 6] and second.response_start == 1
    assert torch.equal(second.taps, taps[1, :2]) and torch.equal(second.target_logits, logits[1, :2])
    assert batch.sequence(0).anchors.tolist() == [1]


class LengthObjective(PerSequenceObjective):
    """A stand-in: loss = the sequence's length, one hit per anchor at position 1."""

    def sequence_loss(self, token_ids, anchors, taps, gamma, target_logits, response_start):
        hits = torch.tensor([0.0, float(anchors.numel())])
        return torch.tensor(float(token_ids.shape[0])), hits, torch.zeros(2), torch.ones(2)


def test_per_sequence_objectives_average_the_losses_and_sum_the_statistics():
    token_ids = pad_right([torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])])
    batch = TrainingBatch(token_ids, [4, 2], [torch.tensor([0, 1]), torch.tensor([0])], [1, 1])
    loss, hits, agreements, counts = LengthObjective()(batch, 1.0)
    assert float(loss) == 3.0
    assert hits.tolist() == [0.0, 3.0] and counts.tolist() == [2.0, 2.0] and agreements.tolist() == [0.0, 0.0]
