"""DEER's objective: evaluation blocks score exactly what the drafter proposes at inference; the
stage 1 and stage 2 recipes mask, weight and isolate their blocks as the paper's Eq. 1-4 say."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.target.model import TargetModel
from diffdraft.train.deer_objective import DEERObjective, _block_rows, _visibility

from diffdraft_testing.targets import tiny_target
from diffdraft_testing.training import assert_batch_matches_each_sequence, sequences_batch


def tiny_deer(seed: int = 3, block_size: int = 4, vocab: int = 32):
    base = tiny_target("llama", seed=seed, vocab=vocab, layers=3)
    return deer_from_causal_lm(base, 2, block_size, vocab - 2, None, "test").double()


def test_evaluation_loss_equals_inference_drafts_scored_against_the_target():
    torch_target = tiny_target("qwen3", seed=2, vocab=32)
    target = TargetModel(torch_target)
    model = tiny_deer(block_size=4)
    ids = torch.randint(1, 30, (16,), generator=torch.Generator().manual_seed(2))
    logits = target.taps_and_logits(ids, []).logits
    anchors = torch.tensor([4, 7, 11])  # every block fits: no truncation at the end
    with torch.no_grad():
        loss, hits, agreements, counts = DEERObjective(model)(
            sequences_batch([(ids, anchors, None, logits, 5)]), 1.0
        )

    drafter = DEERDrafter(model, target)
    total, rows = 0.0, 0
    expected_agreements = torch.zeros(5)
    for root in anchors.tolist():
        drafter.reset()
        drafts = drafter.propose(ids[: root + 1], 4).log_probs.double()
        for depth in range(1, 5):
            target_log_probs = logits[root + depth - 1].double().log_softmax(-1)
            draft = drafts[depth - 1]
            total += float((target_log_probs.exp() * (target_log_probs - draft)).sum())
            rows += 1
            expected_agreements[depth] += float(draft.argmax() == target_log_probs.argmax())
    assert abs(float(loss) - total / rows) < 1e-6
    assert counts.tolist() == [0, 3, 3, 3, 3]
    assert agreements.tolist() == expected_agreements.tolist()
    assert hits.sum() <= counts.sum()


def test_stage_two_masks_a_suffix_and_weights_the_rows_nearest_the_prefix_most():
    ids = torch.arange(1, 41)
    rows = _block_rows(
        ids, torch.tensor([5, 20]), torch.tensor([3, 5]), torch.ones(2), 99, torch.Generator().manual_seed(0)
    )
    assert rows.input_ids.tolist() == [99] * 6  # R - 1 mask rows after each root
    assert rows.positions.tolist() == [6, 7, 21, 22, 23, 24]
    assert rows.label_hidden.all()
    alpha = 1.5
    # row i predicts the (i + 1)-th masked token: weight alpha ** (R - i - 1); roots alpha ** (R - 1)
    assert torch.allclose(rows.weights(alpha, False), torch.tensor([1.5, 1, 1.5**3, 1.5**2, 1.5, 1]))
    assert torch.allclose(rows.root_weights(alpha), torch.tensor([1.5**2, 1.5**4]))


def test_stage_one_trains_a_row_only_when_its_token_is_hidden_and_weights_it_by_one_over_t():
    ids = torch.arange(1, 31)
    noise = torch.tensor([0.5])
    rows = _block_rows(
        ids, torch.tensor([10]), torch.tensor([8]), noise, 99, torch.Generator().manual_seed(1)
    )
    masked = rows.input_ids == 99
    assert 0 < int(masked.sum()) < 7  # t = 0.5: some rows show their true token
    assert torch.equal(rows.input_ids[~masked], ids[rows.positions[~masked]])
    for r in range(7):
        shows_next = r + 1 < 7 and not masked[r + 1]
        assert bool(rows.label_hidden[r]) == (not shows_next)
    assert torch.allclose(rows.weights(1.01, True), torch.full((7,), 2.0))


def test_blocks_see_their_root_s_prefix_and_themselves_only():
    rows = _block_rows(
        torch.arange(12), torch.tensor([3, 6]), torch.tensor([3, 3]), torch.ones(2), 0, torch.Generator()
    )
    visible = _visibility(12, torch.tensor([3, 6]), rows)
    assert torch.equal(visible[:12, :12], torch.ones(12, 12, dtype=torch.bool).tril())
    assert not visible[:12, 12:].any()  # the sequence never sees a block
    block_a, block_b = visible[12:14], visible[14:16]
    assert block_a[:, :4].all() and not block_a[:, 4:12].any()
    assert block_b[:, :7].all() and not block_b[:, 7:12].any()
    assert block_a[:, 12:14].all() and not block_a[:, 14:].any()  # bidirectional inside, not across
    assert block_b[:, 14:16].all() and not block_b[:, 12:14].any()


@pytest.mark.parametrize("stage", [1, 2])
def test_training_stages_give_finite_losses_and_gradients_on_every_layer(stage):
    model = tiny_deer(block_size=5).float()
    ids = torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([8, 15, 22, 30, 38])
    loss, _, _, counts = DEERObjective(model, stage=stage, max_suffix=12)(
        sequences_batch([(ids, anchors, None, None, 8)]), 1.01
    )
    loss.backward()
    assert torch.isfinite(loss) and counts[1:].sum() > 0 and counts[0] == 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_a_padded_batch_gives_each_sequence_s_loss_and_statistics(stage):
    """Sequences of different lengths in one forward: the mean of their losses and the sums of their
    statistics, as one at a time (the noise of each block is drawn per sequence either way)."""
    torch_target = tiny_target("qwen3", seed=5, vocab=32)
    model = tiny_deer(block_size=5)
    objective = DEERObjective(model, stage=stage, max_suffix=12)
    generator = torch.Generator().manual_seed(5)
    cases = []
    for length, anchors, start in ((40, [8, 15, 22, 30], 8), (23, [6, 12, 20], 5), (31, [9, 27], 9)):
        ids = torch.randint(1, 30, (length,), generator=generator)
        logits = TargetModel(torch_target).taps_and_logits(ids, []).logits.double()
        cases.append((ids, torch.tensor(anchors), None, logits, start))
    assert_batch_matches_each_sequence(objective, cases, gamma=1.01)
