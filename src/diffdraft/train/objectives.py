"""Which training objective trains which draft network (each family's recipe is its own file)."""

from __future__ import annotations

from torch import nn

from diffdraft.drafters.checkpoint import DraftModel
from diffdraft.drafters.dart_model import DARTDraftModel
from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.train.dart_objective import DARTObjective
from diffdraft.train.objective import BlockObjective

OBJECTIVES = {DFlashDraftModel: BlockObjective, DARTDraftModel: DARTObjective}


def make_objective(drafter: DraftModel, target_model: nn.Module) -> BlockObjective | DARTObjective:
    """The module that turns one sequence into (loss, hits, agreements, counts) for ``drafter``."""
    return OBJECTIVES[type(drafter)](drafter, target_model)
