"""DART's training objective on one sequence: prefix-shared masked training (DART paper, Sec. 3.3).

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
from diffdraft.train.batch import PerSequenceObjective
from diffdraft.train.loss import draft_loss
from diffdraft.train.objective import head_rows


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


class DARTObjective(PerSequenceObjective):
    """DART drafter + the target's frozen embedding -> (loss, hits, agreements, counts) per sequence.

    Same contract as :class:`~diffdraft.train.objective.BlockObjective`; the per-depth arrays have
    ``max_depth + 1`` entries (index 0 unused). ``anchors`` are sampled like DFlash's (the root
    token's position), so anchor ``a`` is prefix row ``a - 1``.
    """

    def __init__(self, drafter: DARTDraftModel, target_model: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.frozen = [target_model.get_input_embeddings()]
        self.label_index = head_rows(target_model.config.vocab_size, drafter.draft_vocab)

    def sequence_loss(
        self,
        token_ids: torch.Tensor,
        anchors: torch.Tensor,
        taps: torch.Tensor,
        gamma: float,
        target_logits: torch.Tensor | None = None,
        response_start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefix rows train from the response's first root on (row ``response_start - 2``)."""
        (embed,) = self.frozen
        model = self.drafter
        n, draft_length, max_depth = token_ids.shape[0], model.draft_length, model.max_depth
        device, dtype = taps.device, model.norm.weight.dtype
        with torch.no_grad():
            next_embeds = embed(token_ids[1:].to(device)).to(dtype)
        inputs, residual = model.prefix_inputs(taps[: n - 1].to(dtype)[None], next_embeds[None])
        anchor_rows = anchors[anchors >= 1] - 1
        mask_in, mask_res = model.mask_inputs(1, draft_length * anchor_rows.shape[0])
        inputs, residual = torch.cat([inputs, mask_in], 1), torch.cat([residual, mask_res], 1)

        # Each row: its position, the depth it predicts, and the position of the token it predicts.
        prefix = torch.arange(n - 1)
        steps = torch.arange(1, draft_length + 1).repeat(anchor_rows.shape[0])
        owners = anchor_rows.repeat_interleave(draft_length)
        positions = torch.cat([prefix, owners + steps])
        depths = torch.cat([torch.ones(n - 1, dtype=torch.long), steps + 1])
        predicted = torch.cat([prefix + 2, owners + steps + 2])
        is_mask = torch.arange(positions.shape[0]) >= n - 1
        trained = (predicted < n) & (is_mask | (positions >= response_start - 2))

        position_ids = positions.to(device)[None]
        mask = prefix_shared_mask(anchor_rows, draft_length, n - 1).to(device)[None, None]
        hidden = model(inputs, residual, position_ids, model.key_values(inputs, position_ids), mask)[0]
        rows = trained.nonzero().squeeze(-1)
        logits = model.logits(hidden[rows.to(device)])
        labels = self.label_index[token_ids[predicted[rows]].to(device)]
        return draft_loss(
            logits,
            labels,
            depths[rows].to(device),
            dart_weights(max_depth, gamma),
            target_logits,
            (predicted[rows] - 1).to(device),
            self.label_index,
            model.draft_vocab,
        )


def new_dart_drafter(
    target_model: nn.Module,
    draft_length: int,
    target_layer_ids: list[int] | None,
    draft_vocab: torch.Tensor | None,
    intermediate_size: int | None = None,
) -> DARTDraftModel:
    """A fresh DART drafter whose own LM head starts as the target's rows for its draft vocabulary
    (the paper trains the head; starting from the target's is a head start, not a constraint)."""
    config = make_dart_config(
        target_model.config,
        draft_length=draft_length,
        target_layer_ids=target_layer_ids,
        draft_vocab_size=0 if draft_vocab is None else draft_vocab.shape[0],
        intermediate_size=intermediate_size,
    )
    model = DARTDraftModel(config)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    head = target_model.get_output_embeddings().weight.detach().float()
    with torch.no_grad():
        model.lm_head.weight.copy_(head[model.draft_vocab.to(head.device)].cpu())
    return model
