"""The progressive position-weighted loss (DFlare Eq. 5)."""

from __future__ import annotations

import math

import pytest
import torch

from diffdraft.train.blocks import IGNORE
from diffdraft.train.dflash_objective import head_rows
from diffdraft.train.loss import block_loss, gamma_at, position_weights, target_rows


def test_gamma_grows_linearly_from_gamma_0_to_gamma_max():
    assert gamma_at(0, 100, 4.5, 6.5) == 4.5
    assert gamma_at(50, 100, 4.5, 6.5) == 5.5
    assert gamma_at(100, 100, 4.5, 6.5) == 6.5


def test_weights_decay_exponentially_from_the_first_predicted_position():
    w = position_weights(5, gamma=2.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[3]), math.exp(-1.0), rel_tol=1e-6)


def test_loss_is_the_weighted_mean_cross_entropy_and_counts_hits_per_position():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    labels = torch.tensor([1, 2, 3, 4])
    positions = torch.tensor([1, 2, 1, 3])
    loss, hits, counts = block_loss(logits, labels, positions, position_weights(4, 3.0))
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    w = torch.exp(-(positions - 1) / 3.0)
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum())
    assert counts.tolist() == [0, 2, 1, 1]
    assert hits.tolist() == [
        0,
        float((logits[0].argmax() == 1).item() + (logits[2].argmax() == 3).item()),
        float(logits[1].argmax() == 2),
        float(logits[3].argmax() == 4),
    ]


def test_a_label_outside_the_draft_vocabulary_adds_no_loss_but_counts_as_a_miss():
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    labels = torch.tensor([0, IGNORE])
    loss, hits, counts = block_loss(logits, labels, torch.tensor([1, 2]), position_weights(3, 3.0))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[:1], labels[:1]))
    assert hits.tolist() == [0, 1, 0]
    assert counts.tolist() == [0, 1, 1]


def test_distillation_loss_is_the_weighted_kl_from_the_target_and_zero_when_the_drafter_matches_it():
    torch.manual_seed(1)
    logits = torch.randn(3, 7)
    target = torch.randn(3, 7).log_softmax(-1)
    positions = torch.tensor([1, 2, 2])
    loss, _, counts = block_loss(logits, torch.tensor([0, 1, 2]), positions, position_weights(3, 2.0), target)
    draft = logits.log_softmax(-1)
    kl = (target.exp() * (target - draft)).sum(-1)
    w = torch.exp(-(positions - 1) / 2.0)
    torch.testing.assert_close(loss, (kl * w).sum() / w.sum())
    assert counts.tolist() == [0, 1, 2]
    same, _, _ = block_loss(logits, torch.tensor([0, 1, 2]), positions, position_weights(3, 2.0), draft)
    assert abs(float(same)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_draft_vocab", [False, True])
def test_target_rows_equal_gathering_each_rows_logits_first(dtype, with_draft_vocab):
    torch.manual_seed(2)
    vocab_size = 50
    target_logits = torch.randn(9, vocab_size).to(dtype)
    target_logits[4, [3, 7]] = 9.0  # a tie: the first maximum wins, as argmax
    predicted_from = torch.tensor([4, 0, 4, 8, 2, 2, 4])  # rows share positions, some are unused
    draft_vocab = torch.tensor([7, 1, 2, 5, 9, 11, 30]) if with_draft_vocab else None
    head_index = head_rows(vocab_size, draft_vocab) if with_draft_vocab else None
    log_probs, greedy = target_rows(target_logits, predicted_from, head_index, draft_vocab)

    rows = target_logits[predicted_from].float()
    expected_greedy = rows.argmax(-1)
    if with_draft_vocab:
        expected_greedy, rows = head_index[expected_greedy], rows[:, draft_vocab]
    torch.testing.assert_close(log_probs, rows.log_softmax(-1), rtol=0, atol=0)
    assert greedy.tolist() == expected_greedy.tolist()
    assert greedy[0] == (IGNORE if with_draft_vocab else 3)  # token 3 is outside the draft vocabulary
