"""DART training sees exactly what DART inference sees: the prefix-shared loss equals the drafts of
the inference path, scored against the target, row by row."""

from __future__ import annotations

import torch

from diffdraft.drafters.dart import DARTDrafter
from diffdraft.target.model import TargetModel
from diffdraft.train.dart_objective import DARTObjective, dart_weights, prefix_shared_mask

from diffdraft_testing.drafters import tiny_dart
from diffdraft_testing.targets import tiny_target
from diffdraft_testing.training import assert_batch_matches_each_sequence, sequences_batch


def test_prefix_shared_mask_isolates_each_anchor_with_its_prefix():
    mask = prefix_shared_mask(torch.tensor([1, 3]), draft_length=2, prefix_rows=4)
    assert mask.shape == (8, 8)
    assert torch.equal(mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not mask[:4, 4:].any(), "prefix rows never see mask rows"
    # anchor row 1's masks (rows 4, 5) see prefix rows 0-1 and their own earlier masks only
    assert mask[4].tolist() == [True, True, False, False, True, False, False, False]
    assert mask[5].tolist() == [True, True, False, False, True, True, False, False]
    assert mask[7].tolist() == [True, True, True, True, False, False, True, True]


def test_dart_weights_anneal_by_gamma():
    assert dart_weights(3, 0.6).tolist() == torch.tensor([0.0, 1.0, 0.6, 0.36]).tolist()


def test_dart_loss_equals_inference_drafts_scored_against_the_target():
    torch_target = tiny_target("qwen3", seed=2, vocab=32)
    target = TargetModel(torch_target)
    model = tiny_dart(torch_target, seed=2, draft_length=3)
    ids = torch.randint(1, 31, (14,), generator=torch.Generator().manual_seed(2))
    response_start, gamma = 5, 0.6
    out = target.taps_and_logits(ids, model.target_layer_ids)
    anchors = torch.tensor([4, 7, 10])  # root positions, as sample_anchors draws them
    with torch.no_grad():
        loss, hits, agreements, counts = DARTObjective(model, torch_target)(
            sequences_batch([(ids, anchors, out.hidden, out.logits, response_start)]), gamma
        )

    drafter = DARTDrafter(model, target)

    def draft(root: int, depth: int) -> torch.Tensor:
        drafter.reset()
        drafter.extend_context(out.hidden[:root], 0)
        return drafter.propose(ids[: root + 1], depth).log_probs

    rows = [(i + 1, 1) for i in range(response_start - 2, ids.shape[0] - 2)]  # (root, depth): prefix rows
    rows += [(int(a), m + 1) for a in anchors for m in range(1, 4) if int(a) + m + 1 < ids.shape[0]]
    total = weight = 0.0
    expected_counts = torch.zeros(5)
    expected_agreements = torch.zeros(5)
    for root, depth in rows:
        draft_log_probs = draft(root, model.max_depth)[depth - 1].double()
        target_log_probs = out.logits[root + depth - 1].double().log_softmax(-1)
        kl = (target_log_probs.exp() * (target_log_probs - draft_log_probs)).sum()
        total += gamma ** (depth - 1) * float(kl)
        weight += gamma ** (depth - 1)
        expected_counts[depth] += 1
        expected_agreements[depth] += float(draft_log_probs.argmax() == target_log_probs.argmax())
    assert abs(float(loss) - total / weight) < 1e-6
    assert counts.tolist() == expected_counts.tolist()
    assert agreements.tolist() == expected_agreements.tolist()
    assert hits.sum() <= counts.sum()


def test_a_padded_batch_gives_each_sequence_s_loss_and_statistics():
    """Sequences of different lengths and anchor counts in one forward: the mean of their losses and
    the sums of their statistics, as one at a time."""
    torch_target = tiny_target("qwen3", seed=3, vocab=32)
    target = TargetModel(torch_target)
    model = tiny_dart(torch_target, seed=3, draft_length=3)
    objective = DARTObjective(model, torch_target)
    generator = torch.Generator().manual_seed(3)
    cases = []
    for length, anchors, start in ((14, [4, 7, 10], 5), (9, [3, 6], 3), (17, [5, 6, 9, 13], 4)):
        ids = torch.randint(1, 31, (length,), generator=generator)
        out = target.taps_and_logits(ids, model.target_layer_ids)
        cases.append((ids, torch.tensor(anchors), out.hidden, out.logits, start))
    assert_batch_matches_each_sequence(objective, cases, gamma=0.6)
