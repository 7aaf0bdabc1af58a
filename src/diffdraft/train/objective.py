"""The training objective of one sequence: every anchored block in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFlashDraftModel, draft_head
from diffdraft.train.blocks import IGNORE, make_blocks
from diffdraft.train.loss import block_loss


class BlockObjective(nn.Module):
    """Drafter + the target's frozen embedding and LM head -> (loss, hits, counts) per sequence.

    This is the module DDP wraps, so context projection and block forward are one call. The
    target's modules are held in a plain list: not registered, so neither DDP nor the optimizer
    ever touches them.
    """

    def __init__(self, drafter: DFlashDraftModel, target_model: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.frozen = [
            target_model.get_input_embeddings(),
            draft_head(target_model.get_output_embeddings(), drafter.draft_vocab),
        ]
        # Labels index the head's rows: target id -> draft vocabulary index (IGNORE outside it).
        vocab = drafter.draft_vocab
        self.label_index = None
        if vocab is not None:
            self.label_index = torch.full((target_model.config.vocab_size,), IGNORE, dtype=torch.long)
            self.label_index[vocab.cpu()] = torch.arange(vocab.shape[0])

    def forward(
        self, token_ids: torch.Tensor, anchors: torch.Tensor, taps: torch.Tensor, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token_ids`` [n] and ``taps`` [n, T, H] of one sequence; ``anchors`` [m] from sample_anchors."""
        embed, lm_head = self.frozen
        block_size = self.drafter.block_size
        device, dtype = taps.device, self.drafter.norm.weight.dtype
        blocks = make_blocks(token_ids, anchors, block_size, self.drafter.mask_token_id)
        with torch.no_grad():
            block_embeds = embed(blocks.input_ids.to(device)).to(dtype)
        context_positions = torch.arange(token_ids.shape[0], device=device)[None]
        context_kv = self.drafter.context_kv(taps.to(dtype)[None], context_positions)
        hidden = self.drafter(
            block_embeds[None],
            blocks.position_ids.to(device)[None],
            context_kv,
            blocks.attention_mask.to(device)[None, None],
        )[0]
        labelled = (blocks.labels != IGNORE).nonzero().squeeze(-1)
        labels = blocks.labels[labelled]
        if self.label_index is not None:
            labels = self.label_index[labels]
        rows = labelled.to(device)
        bias = None if lm_head.bias is None else lm_head.bias.to(dtype)
        logits = nn.functional.linear(hidden[rows], lm_head.weight.to(dtype), bias)
        return block_loss(logits, labels.to(device), rows % block_size, block_size, gamma)
