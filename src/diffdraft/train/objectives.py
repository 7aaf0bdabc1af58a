"""Which training objective trains which draft network (each family's recipe is its own file)."""

from __future__ import annotations

from torch import nn

from diffdraft.drafters.checkpoint import DraftModel
from diffdraft.drafters.dart_model import DARTDraftModel
from diffdraft.drafters.deer_model import DEERDraftModel
from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.train.dart_objective import DARTObjective
from diffdraft.train.deer_objective import DEERObjective
from diffdraft.train.objective import BlockObjective

Objective = BlockObjective | DARTObjective | DEERObjective


def make_objective(
    drafter: DraftModel, target_model: nn.Module, deer_stage: int = 2, deer_max_suffix: int | None = None
) -> Objective:
    """The module that turns one sequence into (loss, hits, agreements, counts) for ``drafter``.

    DEER's stage and suffix length pick its recipe (:mod:`~diffdraft.train.deer_objective`); the
    defaults give inference-shaped blocks, what evaluation measures."""
    if isinstance(drafter, DEERDraftModel):
        return DEERObjective(drafter, deer_stage, deer_max_suffix)
    family = {DFlashDraftModel: BlockObjective, DARTDraftModel: DARTObjective}[type(drafter)]
    return family(drafter, target_model)
