"""The block training objective of DFlash / DFlare: every anchored block of a batch in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFlashDraftModel, draft_head, make_draft_config
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch
from diffdraft.train.blocks import IGNORE, batch_blocks
from diffdraft.train.config import TrainConfig
from diffdraft.train.loss import draft_loss, position_weights
from diffdraft.train.recipe import TrainingRecipe
from diffdraft.train.target_init import copy_target_layers


class BlockObjective(nn.Module):
    """Drafter + the target's frozen embedding and LM head -> (loss, hits, counts) of a batch.

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
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every anchored block of every sequence in one drafter forward (anchors lie in the
        responses already, so the batch's response starts are not needed here).

        Returns (loss, hits, agreements, counts), the last three per block position [B]: hits match
        the sequences' tokens, agreements the target's own top-1 token given the same prefix (zeros
        without the batch's target logits). The loss is the mean of the sequences' losses: the
        cross-entropy on their tokens, or with target logits KL(target || draft).
        """
        embed, lm_head = self.frozen
        block_size = self.drafter.block_size
        device, dtype = batch.taps.device, self.drafter.norm.weight.dtype
        sequences, context = batch.token_ids.shape
        blocks = batch_blocks(
            batch.token_ids, batch.lengths, batch.anchors, block_size, self.drafter.mask_token_id
        )
        with torch.no_grad():
            block_embeds = embed(blocks.input_ids.to(device)).to(dtype)
        context_positions = torch.arange(context, device=device).expand(sequences, context)
        context_kv = self.drafter.context_kv(batch.taps.to(dtype), context_positions)
        hidden = self.drafter(
            block_embeds,
            blocks.position_ids.to(device),
            context_kv,
            blocks.attention_mask.to(device)[:, None],
        )
        sequence, row = (blocks.labels != IGNORE).nonzero().to(device).unbind(-1)
        labels = self._head_index(blocks.labels.to(device)[sequence, row])
        bias = None if lm_head.bias is None else lm_head.bias.to(dtype)
        logits = nn.functional.linear(hidden[sequence, row], lm_head.weight.to(dtype), bias)
        # the token at position p is what the target predicted at position p - 1
        previous = sequence * context + blocks.position_ids.to(device)[sequence, row] - 1
        target_logits = None if batch.target_logits is None else batch.target_logits.flatten(0, 1)
        return draft_loss(
            logits,
            labels,
            row % block_size,
            position_weights(block_size, gamma),
            target_logits,
            previous,
            self.label_index,
            self.drafter.draft_vocab,
            sequence,
            sequences,
        )

    def _head_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> rows of the draft head (IGNORE for tokens outside the draft vocabulary)."""
        return token_ids if self.label_index is None else self.label_index[token_ids]


def head_rows(vocab_size: int, draft_vocab: torch.Tensor) -> torch.Tensor:
    """[vocab_size] the draft head's row of each target token id (IGNORE outside the draft vocabulary):
    labels index the head's rows. On the draft vocabulary's device, where the labels are."""
    rows = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    rows[draft_vocab.cpu()] = torch.arange(draft_vocab.shape[0])
    return rows.to(draft_vocab.device)


def new_block_drafter(
    config: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None
) -> DFlashDraftModel:
    """A fresh DFlash / DFlare drafter (``config.variant``) for ``target``: its layers copied from the
    target's last ones (``init_layers="target"``) or random with a final norm scaled for the
    borrowed LM head."""
    draft_config = make_draft_config(
        target.config,
        num_layers=config.num_layers,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=config.target_layer_ids,
        variant=config.variant,
        intermediate_size=config.intermediate_size,
        draft_vocab_size=0 if draft_vocab is None else draft_vocab.shape[0],
    )
    drafter = DFlashDraftModel(draft_config)
    if draft_vocab is not None:
        drafter.draft_vocab.copy_(draft_vocab)
    return start_layers(drafter, config, target)


def start_layers(drafter: DFlashDraftModel, config: TrainConfig, target: TargetModel) -> DFlashDraftModel:
    """A fresh DFlash-style network's starting layers (DFlash2 and DSpark start alike): copies of the
    target's last ones (``init_layers="target"``), or random with a final norm scaled for the borrowed
    LM head. Returns ``drafter``."""
    if config.init_layers == "target":
        copy_target_layers(drafter, target.model)
        return drafter
    # Start with logits of unit scale through the borrowed LM head: a unit final norm against
    # SmolLM2's head started training far above the uniform distribution's loss (docs/decisions.md,
    # "a borrowed head's final norm scaled to unit logits").
    head = target.model.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        drafter.norm.weight.fill_(float(head.norm(dim=1).pow(2).mean().rsqrt()))
    return drafter


RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: BlockObjective(drafter, target_model),
    new_model=new_block_drafter,
    gamma_0=4.5,
    fixed_gamma=False,
)
"""DFlash / DFlare's recipe: DFlare's weighting exp(-(k-1)/gamma), gamma rising 1 per epoch from 4.5."""
