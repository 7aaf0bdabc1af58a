"""The block objective: which target row labels which block row, and what a block row can see."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch, pad_right
from diffdraft.train.blocks import make_blocks
from diffdraft.train.dflash_objective import BlockObjective

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


def one_sequence(ids, anchors, taps, target_logits=None) -> TrainingBatch:
    batch = TrainingBatch(ids[None], [ids.shape[0]], [anchors], [0], taps[None])
    batch.target_logits = None if target_logits is None else target_logits[None]
    return batch


def test_distilling_a_target_certain_of_the_next_token_equals_cross_entropy_on_that_token():
    """Soft labels are shifted like hard ones: block row ``a + k`` learns the target's row ``a + k - 1``."""
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(target, block_size=4, variant=DFLARE)
    objective = BlockObjective(drafter, target)
    ids = torch.randint(1, 60, (20,), generator=torch.Generator().manual_seed(0))
    taps = TargetModel(target).taps(ids, drafter.target_layer_ids)
    anchors = torch.tensor([3, 8, 15])
    certain = torch.full((20, 64), -1e4)
    certain[torch.arange(19), ids[1:]] = 0.0  # row p is sure of the token at p + 1
    hard, hits, _, counts = objective(one_sequence(ids, anchors, taps), 2.0)
    soft, soft_hits, agreements, soft_counts = objective(one_sequence(ids, anchors, taps, certain), 2.0)
    torch.testing.assert_close(soft, hard, rtol=1e-4, atol=1e-4)
    assert torch.equal(hits, soft_hits) and torch.equal(counts, soft_counts)
    assert torch.equal(agreements, hits)  # the target's top-1 is the sequence's token


def test_a_block_sees_the_target_strictly_before_its_anchor_as_eagle_drafters_do():
    """Position 1 of a block anchored at ``a`` predicts token ``a + 1`` from the target's features
    up to ``a - 1`` and the anchor token itself: the features EAGLE feeds its first draft step."""
    target = tiny_target(dtype=torch.float64)
    drafter = tiny_drafter(target, block_size=4, variant=DFLARE).double()
    ids = torch.randint(1, 60, (16,), generator=torch.Generator().manual_seed(1))
    taps = TargetModel(target).taps(ids, drafter.target_layer_ids)
    anchor = 9
    blocks = make_blocks(ids, torch.tensor([anchor]), 4, drafter.mask_token_id)

    def block_hidden(features: torch.Tensor) -> torch.Tensor:
        context = drafter.context_kv(features[None], torch.arange(16)[None])
        embeds = target.get_input_embeddings()(blocks.input_ids)[None]
        return drafter(embeds, blocks.position_ids[None], context, blocks.attention_mask[None, None])[0]

    reference = block_hidden(taps)
    later = taps.clone()
    later[anchor:] += torch.randn_like(later[anchor:])
    torch.testing.assert_close(block_hidden(later), reference, rtol=0, atol=0)
    last_seen = taps.clone()
    last_seen[anchor - 1] += 1.0
    assert not torch.allclose(block_hidden(last_seen)[1], reference[1])
    assert blocks.input_ids[0] == ids[anchor] and blocks.labels[1] == ids[anchor + 1]


@pytest.mark.parametrize("distilled", [False, True])
def test_a_padded_batch_trains_as_its_sequences_one_by_one(distilled):
    """One forward over right-padded sequences of different lengths: the loss is the mean of the
    sequences' own losses, the statistics their sums, and so are the gradients."""
    torch_target = tiny_target(dtype=torch.float64)
    target = TargetModel(torch_target)
    drafter = tiny_drafter(torch_target, block_size=4, variant=DFLARE).double()
    objective = BlockObjective(drafter, torch_target)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(1, 60, (n,), generator=generator) for n in (11, 23, 17)]
    anchors = [torch.tensor([2, 5, 9]), torch.tensor([4, 10, 18, 21]), torch.tensor([7])]

    def run(batch: TrainingBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        drafter.zero_grad()
        outputs = list(objective(batch, 2.0))
        outputs[0].backward()
        return outputs, [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    singles = []
    for ids, a in zip(sequences, anchors, strict=True):
        out = target.taps_and_logits(ids, drafter.target_layer_ids)
        singles.append(run(one_sequence(ids, a, out.hidden, out.logits if distilled else None)))
    padded = pad_right(sequences)
    out = target.taps_and_logits(padded, drafter.target_layer_ids)
    batch = TrainingBatch(padded, [s.shape[0] for s in sequences], anchors, [0] * 3, out.hidden)
    batch.target_logits = out.logits if distilled else None
    (loss, *statistics), grads = run(batch)

    torch.testing.assert_close(loss, sum(s[0][0] for s in singles) / 3)
    for k, summed in enumerate(statistics, start=1):
        torch.testing.assert_close(summed, sum(s[0][k] for s in singles))
    for i, grad in enumerate(grads):
        torch.testing.assert_close(grad, sum(s[1][i] for s in singles) / 3)
