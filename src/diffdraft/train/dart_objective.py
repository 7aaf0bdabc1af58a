"""DART's training objective: prefix-shared masked training (DART paper, Sec. 3.3).

Every prefix row of the sequence is computed once, causally, and is itself a depth-1 prediction
(shifted logits: row i, holding the target's features at i and the embedding of token i + 1,
predicts token i + 2). For sampled anchor rows i, ``draft_length`` mask rows at positions
i + 1 .. i + D see the prefix up to row i and the earlier masks of the same anchor (nothing
else), exactly what they see at inference; mask m predicts depth m + 1, token i + m + 2. The loss
is the annealed KL of DART's Eq. (2): depth t weighted by gamma ** (t - 1), against the target's
own next-token distributions from the forward that gave the features.
"""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dart_model import DARTDraftModel, make_dart_config
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch, pad_right, pad_square_masks
from diffdraft.train.config import TrainConfig
from diffdraft.train.dflash_objective import head_rows
from diffdraft.train.loss import draft_loss
from diffdraft.train.recipe import TrainingRecipe


def dart_weights(max_depth: int, gamma: float) -> torch.Tensor:
    """[max_depth + 1] loss weight per depth (index 0 unused): gamma ** (depth - 1)."""
    weights = gamma ** (torch.arange(max_depth + 1, dtype=torch.float32) - 1)
    weights[0] = 0.0
    return weights


def prefix_shared_mask(anchor_rows: torch.Tensor, draft_length: int, prefix_rows: int) -> torch.Tensor:
    """[q, q] bool over ``[prefix rows ; mask rows]`` (True = may attend); see the module docstring."""
    prefix = torch.arange(prefix_rows)
    owner = anchor_rows.repeat_interleave(draft_length)  # anchor row of each mask row
    step = torch.arange(draft_length).repeat(anchor_rows.shape[0])
    group = torch.arange(anchor_rows.shape[0]).repeat_interleave(draft_length)
    prefix_sees = torch.cat(
        [prefix[:, None] >= prefix[None, :], torch.zeros(prefix_rows, owner.shape[0], dtype=torch.bool)],
        dim=1,
    )
    masks_see_prefix = prefix[None, :] <= owner[:, None]
    masks_see_masks = (group[:, None] == group[None, :]) & (step[None, :] <= step[:, None])
    return torch.cat([prefix_sees, torch.cat([masks_see_prefix, masks_see_masks], dim=1)], dim=0)


class DARTObjective(nn.Module):
    """DART drafter + the target's frozen embedding -> (loss, hits, agreements, counts) of a batch.

    Same contract as :class:`~diffdraft.train.dflash_objective.BlockObjective`; the per-depth arrays have
    ``max_depth + 1`` entries (index 0 unused). ``anchors`` are sampled like DFlash's (the root
    token's position), so anchor ``a`` is prefix row ``a - 1``. The whole batch is one drafter
    forward: each sequence's rows are its ``L - 1`` prefix rows (``L`` the padded length; rows past
    its own end predict nothing and no row of it sees them) and then its mask rows.
    """

    def __init__(self, drafter: DARTDraftModel, target_model: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.frozen = [target_model.get_input_embeddings()]
        self.label_index = head_rows(target_model.config.vocab_size, drafter.draft_vocab)

    def forward(
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefix rows train from each response's first root on (row ``response_start - 2``)."""
        (embed,) = self.frozen
        model = self.drafter
        sequences, width = batch.token_ids.shape
        device, dtype = batch.taps.device, model.norm.weight.dtype
        layouts = [
            _RowLayout(width - 1, length, anchors[anchors >= 1] - 1, model.draft_length, start)
            for length, anchors, start in zip(
                batch.lengths, batch.anchors, batch.response_starts, strict=True
            )
        ]
        masks = max(layout.mask_rows for layout in layouts)
        with torch.no_grad():
            next_embeds = embed(batch.token_ids[:, 1:].to(device)).to(dtype)
        inputs, residual = model.prefix_inputs(batch.taps[:, : width - 1].to(dtype), next_embeds)
        mask_in, mask_res = model.mask_inputs(sequences, masks)
        inputs, residual = torch.cat([inputs, mask_in], 1), torch.cat([residual, mask_res], 1)
        position_ids = pad_right([layout.positions for layout in layouts]).to(device)
        visible = pad_square_masks([layout.mask for layout in layouts]).to(device)[:, None]
        hidden = model(inputs, residual, position_ids, model.key_values(inputs, position_ids), visible)

        sequence = torch.cat([torch.full_like(layout.rows, i) for i, layout in enumerate(layouts)])
        rows = torch.cat([layout.rows for layout in layouts])
        predicted = torch.cat([layout.predicted[layout.rows] for layout in layouts])
        depths = torch.cat([layout.depths[layout.rows] for layout in layouts])
        logits = model.logits(hidden[sequence.to(device), rows.to(device)])
        labels = self.label_index[batch.token_ids[sequence, predicted].to(device)]
        target_logits = None if batch.target_logits is None else batch.target_logits.flatten(0, 1)
        return draft_loss(
            logits,
            labels,
            depths.to(device),
            dart_weights(model.max_depth, gamma),
            target_logits,
            (sequence * width + predicted - 1).to(device),
            self.label_index,
            model.draft_vocab,
            sequence.to(device),
            sequences,
        )


class _RowLayout:
    """One sequence's rows in a batched DART forward: ``prefix_rows`` prefix rows (at least its
    own ``length - 1``), then ``draft_length`` mask rows per anchor row. Per row: its position,
    the depth it predicts and the position of the token it predicts; ``rows`` are the trained ones."""

    def __init__(
        self, prefix_rows: int, length: int, anchor_rows: torch.Tensor, draft_length: int, response_start: int
    ) -> None:
        prefix = torch.arange(prefix_rows)
        steps = torch.arange(1, draft_length + 1).repeat(anchor_rows.shape[0])
        owners = anchor_rows.repeat_interleave(draft_length)
        self.mask_rows = steps.shape[0]
        self.positions = torch.cat([prefix, owners + steps])
        self.depths = torch.cat([torch.ones(prefix_rows, dtype=torch.long), steps + 1])
        self.predicted = torch.cat([prefix + 2, owners + steps + 2])
        is_mask = torch.arange(self.positions.shape[0]) >= prefix_rows
        trained = (self.predicted < length) & (is_mask | (self.positions >= response_start - 2))
        self.rows = trained.nonzero().squeeze(-1)
        self.mask = prefix_shared_mask(anchor_rows, draft_length, prefix_rows)


def new_dart_drafter(
    config: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None
) -> DARTDraftModel:
    """A fresh DART drafter whose own LM head starts as the target's rows for its draft vocabulary
    (the paper trains the head; starting from the target's is a head start, not a constraint)."""
    dart_config = make_dart_config(
        target.model.config,
        draft_length=config.draft_length,
        target_layer_ids=config.target_layer_ids,
        draft_vocab_size=0 if draft_vocab is None else draft_vocab.shape[0],
        intermediate_size=config.intermediate_size,
    )
    model = DARTDraftModel(dart_config)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    head = target.model.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        model.lm_head.weight.copy_(head[model.draft_vocab.to(head.device)].cpu())
    return model


RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: DARTObjective(drafter, target_model),
    new_model=new_dart_drafter,
    gamma_0=0.6,
    fixed_gamma=True,
    needs_mask_token=False,
)
"""DART's recipe: its weighting gamma ** (t-1), gamma fixed at 0.6 (its Table 4); it learns its mask
embeddings, so a new network needs no mask token."""
