"""How one training sequence becomes many draft blocks trained in a single forward.

Anchors are sampled among response positions; block ``j`` is ``[x[a_j], MASK x (B-1)]`` at
positions ``a_j .. a_j + B - 1`` and block position ``k`` is labelled ``x[a_j + k]`` (no shift:
position k predicts anchor + k). A block-sparse mask mirrors inference exactly: a block sees the
target context strictly before its anchor and its own block bidirectionally, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffdraft.train.batch import TrainingBatch

IGNORE = -100
"""Label of block positions past the end of the sequence (and of every anchor position)."""


@dataclass
class Blocks:
    """One sequence's blocks (shapes below), or a batch's with a leading [b] (:func:`batch_blocks`)."""

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


def batch_blocks(
    token_ids: torch.Tensor,
    lengths: list[int],
    anchors: list[torch.Tensor],
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """The blocks of right-padded sequences ``token_ids`` [b, L], padded to the most rows [b, R];
    masks [b, R, L + R] over each sequence's ``[context ; blocks]``.

    A padding row is a mask token labelled IGNORE that sees only itself (a row that sees nothing
    would make attention NaN); no real row sees it, nor the context padding.
    """
    per_sequence = [
        make_blocks(token_ids[i, :n], a, block_size, mask_token_id)
        for i, (n, a) in enumerate(zip(lengths, anchors, strict=True))
    ]
    batch, context = token_ids.shape[0], token_ids.shape[1]
    rows = max(b.input_ids.shape[0] for b in per_sequence)
    input_ids = torch.full((batch, rows), mask_token_id, dtype=torch.long)
    position_ids = torch.zeros((batch, rows), dtype=torch.long)
    labels = torch.full((batch, rows), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((batch, rows, context + rows), dtype=torch.bool)
    attention_mask[:, torch.arange(rows), context + torch.arange(rows)] = True
    for i, (n, blocks) in enumerate(zip(lengths, per_sequence, strict=True)):
        r = blocks.input_ids.shape[0]
        input_ids[i, :r] = blocks.input_ids
        position_ids[i, :r] = blocks.position_ids
        labels[i, :r] = blocks.labels
        attention_mask[i, :r, :n] = blocks.attention_mask[:, :n]
        attention_mask[i, :r, context : context + r] = blocks.attention_mask[:, n:]
    return Blocks(input_ids, position_ids, labels, attention_mask)


@dataclass
class DraftedRows:
    """The rows of :func:`batch_blocks` that draft a token inside their sequence, flattened [r]."""

    sequence: torch.Tensor
    """Each row's sequence in the batch."""
    row: torch.Tensor
    """Each row's index among its sequence's block rows."""
    depth: torch.Tensor
    """Each row's drafted depth, 1 .. the drafter's max depth (the block position DFlash labels)."""
    label_position: torch.Tensor
    """Where in its sequence the token each row drafts is; that token follows ``label_position - 1``."""


def drafted_rows(
    blocks: Blocks, lengths: list[int], anchors: list[torch.Tensor], block_size: int, anchor_rows: int
) -> DraftedRows:
    """The rows of a batch's blocks (:func:`batch_blocks`) that draft a token of their sequence.

    ``anchor_rows`` is the drafter's (:attr:`~diffdraft.drafters.dflash_model.DFlashDraftModel.anchor_rows`):
    with 1 (DFlash, DFlash2) block row ``k`` drafts the token at ``anchor + k``, ``k >= 1``, as
    :func:`make_blocks` labels it; with 0 (DSpark) every row drafts, row ``k`` the token at
    ``anchor + k + 1``, so a block of B rows drafts B tokens. Rows past a sequence's end draft nothing."""
    rows = blocks.position_ids.shape[1]
    index = torch.arange(rows)
    real = torch.stack([index < anchor.shape[0] * block_size for anchor in anchors])
    depth = (index % block_size + 1 - anchor_rows).expand_as(real)
    label_position = blocks.position_ids + 1 - anchor_rows
    inside = label_position < torch.tensor(lengths)[:, None]
    sequence, row = (real & inside & (depth >= 1)).nonzero().unbind(-1)
    return DraftedRows(sequence, row, depth[sequence, row], label_position[sequence, row])


@dataclass
class DraftedStates:
    """A batch's drafting rows (:func:`drafted_rows`) after one drafter forward, on the drafter's device."""

    states: torch.Tensor
    """Each row's final hidden state [r, H]."""
    sequence: torch.Tensor
    depth: torch.Tensor
    position: torch.Tensor
    """Where in its sequence the token each row drafts is (``DraftedRows.label_position``)."""
    tokens: torch.Tensor
    """The batch's token ids [sequences, context]."""


def drafted_states(drafter: torch.nn.Module, embed: torch.nn.Module, batch: TrainingBatch) -> DraftedStates:
    """Every anchored block of every sequence of ``batch`` (its taps, token ids, lengths and anchors)
    through ``drafter`` in one forward, the target's frozen ``embed`` giving the block rows' inputs:
    what the DFlash2 and DSpark objectives both score, each with its own head."""
    device, dtype = batch.taps.device, drafter.norm.weight.dtype
    sequences, context = batch.token_ids.shape
    blocks = batch_blocks(
        batch.token_ids, batch.lengths, batch.anchors, drafter.block_size, drafter.mask_token_id
    )
    with torch.no_grad():
        block_embeds = embed(blocks.input_ids.to(device)).to(dtype)
    context_positions = torch.arange(context, device=device).expand(sequences, context)
    context_kv = drafter.context_kv(batch.taps.to(dtype), context_positions)
    hidden = drafter(
        block_embeds, blocks.position_ids.to(device), context_kv, blocks.attention_mask.to(device)[:, None]
    )
    rows = drafted_rows(blocks, batch.lengths, batch.anchors, drafter.block_size, drafter.anchor_rows)
    sequence = rows.sequence.to(device)
    return DraftedStates(
        hidden[sequence, rows.row.to(device)],
        sequence,
        rows.depth.to(device),
        rows.label_position.to(device),
        batch.token_ids.to(device),
    )
