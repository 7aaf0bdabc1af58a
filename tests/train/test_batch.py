"""Micro-batches: right padding of sequences and of visibility masks."""

from __future__ import annotations

import torch

from diffdraft.train.batch import PAD, pad_right, pad_square_masks


def test_padding_goes_after_each_sequence_up_to_the_longest():
    padded = pad_right([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert padded.tolist() == [[5, 6, 7], [8, PAD, PAD]]
    features = pad_right([torch.ones(2, 3), torch.ones(1, 3)])
    assert features.shape == (2, 2, 3) and features[1, 1].eq(0).all()


def test_padded_masks_keep_each_mask_and_let_padding_rows_see_only_themselves():
    small, large = torch.tensor([[True, False], [True, True]]), torch.ones(3, 3, dtype=torch.bool)
    padded = pad_square_masks([small, large])
    assert padded.shape == (2, 3, 3)
    assert padded[0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert torch.equal(padded[1], large)
