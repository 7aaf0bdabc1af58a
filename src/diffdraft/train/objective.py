"""The training objective of one sequence: every anchored block in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFlashDraftModel
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
        self.frozen = [target_model.get_input_embeddings(), target_model.get_output_embeddings()]

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
        rows = (blocks.labels != IGNORE).nonzero().squeeze(-1).to(device)
        logits = nn.functional.linear(hidden[rows], lm_head.weight.to(dtype))
        return block_loss(logits, blocks.labels.to(device)[rows], rows % block_size, block_size, gamma)
