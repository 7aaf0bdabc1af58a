"""How one training sequence becomes many draft blocks trained in a single forward.

Anchors are sampled among response positions; block ``j`` is ``[x[a_j], MASK x (B-1)]`` at
positions ``a_j .. a_j + B - 1`` and block position ``k`` is labelled ``x[a_j + k]`` (no shift:
position k predicts anchor + k). A block-sparse mask mirrors inference exactly: a block sees the
target context strictly before its anchor and its own block bidirectionally, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100
"""Label of block positions past the end of the sequence (and of every anchor position)."""


@dataclass
class Blocks:
    anchors: torch.Tensor
    """[m] anchor positions, sorted."""
    input_ids: torch.Tensor
    """[m * B] anchor token then mask tokens, block after block."""
    position_ids: torch.Tensor
    """[m * B] absolute positions of the block rows."""
    labels: torch.Tensor
    """[m * B] target token per block row; IGNORE for anchors and rows past the sequence end."""
    attention_mask: torch.Tensor
    """[m * B, n + m * B] bool over [context ; blocks]; True = may attend."""


def sample_anchors(
    response_start: int, length: int, count: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Up to ``count`` distinct anchors in ``[response_start - 1, length - 2]``, sorted.

    The last prompt token is a valid anchor: at inference the first drafted block is anchored on
    the token that precedes the response.
    """
    first = max(response_start - 1, 0)
    candidates = length - 1 - first
    if candidates <= 0:
        return torch.zeros(0, dtype=torch.long)
    chosen = torch.randperm(candidates, generator=generator)[:count] + first
    return chosen.sort().values


def make_blocks(
    token_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> Blocks:
    n, m = token_ids.shape[0], anchors.shape[0]
    offsets = torch.arange(block_size)
    positions = (anchors[:, None] + offsets).reshape(-1)
    input_ids = torch.full((m, block_size), mask_token_id, dtype=torch.long)
    input_ids[:, 0] = token_ids[anchors]
    labels = torch.where(positions < n, token_ids[positions.clamp_max(n - 1)], IGNORE).view(m, block_size)
    labels[:, 0] = IGNORE
    return Blocks(
        anchors=anchors,
        input_ids=input_ids.reshape(-1),
        position_ids=positions,
        labels=labels.reshape(-1),
        attention_mask=block_attention_mask(anchors, block_size, n),
    )


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_length: int) -> torch.Tensor:
    block_of_row = torch.arange(anchors.shape[0]).repeat_interleave(block_size)
    sees_context = torch.arange(context_length)[None, :] < anchors[block_of_row][:, None]
    sees_block = block_of_row[:, None] == block_of_row[None, :]
    return torch.cat([sees_context, sees_block], dim=1)
