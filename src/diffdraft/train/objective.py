"""The training objective of one sequence: every anchored block in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFlashDraftModel, draft_head
from diffdraft.train.blocks import IGNORE, make_blocks
from diffdraft.train.loss import draft_loss, position_weights


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
        vocab = drafter.draft_vocab
        self.label_index = None if vocab is None else head_rows(target_model.config.vocab_size, vocab)

    def forward(
        self,
        token_ids: torch.Tensor,
        anchors: torch.Tensor,
        taps: torch.Tensor,
        gamma: float,
        target_logits: torch.Tensor | None = None,
        response_start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token_ids`` [n] and ``taps`` [n, T, H] of one sequence; ``anchors`` [m] from sample_anchors
        (they lie in the response already, so ``response_start`` is not needed here).

        Returns (loss, hits, agreements, counts), the last three per block position [B]: hits match
        the sequence's tokens, agreements the target's own top-1 token given the same prefix (zeros
        without ``target_logits``). ``target_logits`` [n, V], the target's next-token logits over the
        sequence, switch the loss from cross-entropy on the tokens to KL(target || draft).
        """
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
        labels = self._head_index(blocks.labels[labelled]).to(device)
        rows = labelled.to(device)
        block_positions = rows % block_size
        bias = None if lm_head.bias is None else lm_head.bias.to(dtype)
        logits = nn.functional.linear(hidden[rows], lm_head.weight.to(dtype), bias)
        # the token at position p is what the target predicted at position p - 1
        previous = blocks.position_ids[labelled].to(device) - 1
        return draft_loss(
            logits,
            labels,
            block_positions,
            position_weights(block_size, gamma),
            target_logits,
            previous,
            self.label_index,
            self.drafter.draft_vocab,
        )

    def _head_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> rows of the draft head (IGNORE for tokens outside the draft vocabulary)."""
        return token_ids if self.label_index is None else self.label_index[token_ids]


def head_rows(vocab_size: int, draft_vocab: torch.Tensor) -> torch.Tensor:
    """[vocab_size] the draft head's row of each target token id (IGNORE outside the draft vocabulary):
    labels index the head's rows."""
    rows = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    rows[draft_vocab.cpu()] = torch.arange(draft_vocab.shape[0])
    return rows
