"""Checks that a drafter fits its target. A drafter trained for another target fails silently (low
acceptance, or wrong features read), so every family fails loudly instead, with the same messages."""

from __future__ import annotations

import torch

from diffdraft.errors import IncompatibleDrafterError
from diffdraft.target.model import TargetModel


def check_fits_target(
    kind: str,
    hidden_size: int,
    vocab_size: int,
    draft_vocab: torch.Tensor | None,
    num_target_layers: int | None,
    layer_ids: list[int],
    target: TargetModel,
) -> None:
    """``kind`` names the drafter in messages; ``hidden_size`` is the width of the target features it
    reads; ``draft_vocab`` the target ids its head scores (None: all); ``num_target_layers`` the
    depth of the target it was trained on (None: not recorded)."""
    if hidden_size != target.hidden_size:
        raise IncompatibleDrafterError(
            f"{kind} hidden size {hidden_size} != target hidden size {target.hidden_size}: "
            "this drafter was trained for a different target; train one for this target (diffdraft train)"
        )
    if vocab_size != target.vocab_size:
        raise IncompatibleDrafterError(
            f"{kind} vocab size {vocab_size} != target vocab size {target.vocab_size}: "
            "the drafter belongs to another target (tokenizers must match)"
        )
    if (
        draft_vocab is not None
        and draft_vocab.numel()
        and not 0 <= int(draft_vocab.min()) <= int(draft_vocab.max()) < target.vocab_size
    ):
        raise IncompatibleDrafterError(
            f"{kind} draft_vocab holds token ids outside the target vocabulary (size {target.vocab_size}): "
            "the drafter belongs to another target"
        )
    if num_target_layers is not None and num_target_layers != target.num_layers:
        raise IncompatibleDrafterError(
            f"{kind} was trained on a target with {num_target_layers} layers, "
            f"this target has {target.num_layers}"
        )
    target.check_layer_ids(layer_ids)
