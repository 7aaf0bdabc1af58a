"""Training blocks: the mask equals one built position by position; labels are not shifted."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffdraft.train.blocks import IGNORE, batch_blocks, make_blocks, sample_anchors


def reference_mask(anchors: list[int], block_size: int, n: int) -> torch.Tensor:
    rows = len(anchors) * block_size
    mask = torch.zeros(rows, n + rows, dtype=torch.bool)
    for row in range(rows):
        block = row // block_size
        for col in range(n):
            mask[row, col] = col < anchors[block]  # strictly before the anchor
        for col in range(rows):
            mask[row, n + col] = col // block_size == block  # own block, both directions
    return mask


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 40), st.integers(2, 8), st.integers(1, 12), st.integers(0, 1000), st.data())
def test_mask_and_labels_match_a_position_by_position_reference(n, block_size, count, seed, data):
    response_start = data.draw(st.integers(1, n - 1))
    anchors = sample_anchors(response_start, n, count, torch.Generator().manual_seed(seed))
    assert anchors.tolist() == sorted(set(anchors.tolist()))
    assert all(response_start - 1 <= a <= n - 2 for a in anchors.tolist())
    tokens = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed))
    blocks = make_blocks(tokens, anchors, block_size, mask_token_id=99)

    assert torch.equal(blocks.attention_mask, reference_mask(anchors.tolist(), block_size, n))
    for j, a in enumerate(anchors.tolist()):
        rows = slice(j * block_size, (j + 1) * block_size)
        assert blocks.input_ids[rows].tolist() == [int(tokens[a])] + [99] * (block_size - 1)
        assert blocks.position_ids[rows].tolist() == list(range(a, a + block_size))
        for k in range(block_size):
            expected = IGNORE if k == 0 or a + k >= n else int(tokens[a + k])  # position k predicts a + k
            assert int(blocks.labels[j * block_size + k]) == expected


def test_no_anchor_when_the_response_has_no_token_to_predict():
    assert sample_anchors(5, 5, 4, None).numel() == 0


def test_a_batch_of_blocks_is_each_sequence_s_blocks_and_padding_nobody_sees():
    lengths, block_size = [7, 12, 4], 3
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (3, 12), generator=generator)
    anchors = [torch.tensor([1, 4]), torch.tensor([0, 3, 6, 10]), torch.tensor([2])]
    batch = batch_blocks(tokens, lengths, anchors, block_size, mask_token_id=99)
    rows = 4 * block_size
    assert batch.input_ids.shape == (3, rows) and batch.attention_mask.shape == (3, rows, 12 + rows)
    for i, (n, a) in enumerate(zip(lengths, anchors, strict=True)):
        alone = make_blocks(tokens[i, :n], a, block_size, mask_token_id=99)
        r = alone.input_ids.shape[0]
        assert torch.equal(batch.input_ids[i, :r], alone.input_ids)
        assert torch.equal(batch.position_ids[i, :r], alone.position_ids)
        assert torch.equal(batch.labels[i, :r], alone.labels)
        mask = batch.attention_mask[i]
        assert torch.equal(mask[:r, :n], alone.attention_mask[:, :n])
        assert not mask[:, n:12].any(), "the context padding is visible"
        assert torch.equal(mask[:r, 12 : 12 + r], alone.attention_mask[:, n:])
        assert not mask[:r, 12 + r :].any(), "a real row sees padding rows"
        assert (batch.labels[i, r:] == IGNORE).all()
        assert torch.equal(mask[r:, 12 + r :], torch.eye(rows - r, dtype=torch.bool))  # only themselves
        assert not mask[r:, : 12 + r].any()
