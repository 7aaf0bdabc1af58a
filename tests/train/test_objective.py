"""The block objective: which target row labels which block row, and what a block row can see."""

from __future__ import annotations

import torch

from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.target import TargetModel
from diffdraft.train.blocks import make_blocks
from diffdraft.train.objective import BlockObjective

from conftest import tiny_drafter, tiny_target


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
    hard, hits, _, counts = objective(ids, anchors, taps, 2.0)
    soft, soft_hits, agreements, soft_counts = objective(ids, anchors, taps, 2.0, certain)
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
