"""Which drafter runs which draft network: the one place that maps a loaded checkpoint to its
:class:`~diffdraft.drafters.base.Drafter`, so nothing else asks what family a checkpoint is."""

from __future__ import annotations

import os

from diffdraft.drafters import dart, deer, dflash
from diffdraft.drafters.checkpoint import DraftModel, load_draft_model
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.dart_model import DARTDraftModel
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import DEERDraftModel
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.target import TargetModel

DRAFTERS = {DFlashDraftModel: DFlashDrafter, DARTDraftModel: DARTDrafter, DEERDraftModel: DEERDrafter}
COMPATIBILITY_CHECKS = {
    DFlashDraftModel: dflash.check_compatible,
    DARTDraftModel: dart.check_compatible,
    DEERDraftModel: deer.check_compatible,
}
Drafters = DFlashDrafter | DARTDrafter | DEERDrafter


def make_drafter(model: DraftModel | str | os.PathLike, target: TargetModel, tokenizer=None) -> Drafters:
    """The drafter for a draft network, or for the checkpoint directory (or shipped name) holding one.

    With ``tokenizer`` (the target's), a drafter that records the tokenizer it was built with is
    also checked against it (DEER reads token ids only, so a vocabulary of equal size is not enough).
    """
    if not isinstance(model, tuple(DRAFTERS)):
        model = load_draft_model(model)
    if tokenizer is not None and isinstance(model, DEERDraftModel):
        deer.check_tokenizer(model, tokenizer)
    return DRAFTERS[type(model)](model, target)


def check_compatible(model: DraftModel, target: TargetModel) -> None:
    """Raise :class:`~diffdraft.errors.IncompatibleDrafterError` if ``model`` was made for another target."""
    COMPATIBILITY_CHECKS[type(model)](model, target)
