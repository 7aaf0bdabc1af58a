"""Each drafter family's training recipe: the training side of its record in
:mod:`diffdraft.drafters.families` (kept here, so drafters/ never imports train/). The trainer, the
evaluation and ``train fit`` ask the recipe instead of the family's name; a new family is its own
objective file plus one entry in :data:`RECIPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffdraft.drafters.dart_model import DART
from diffdraft.drafters.deer_model import DEER
from diffdraft.drafters.dflash_model import DFLASH
from diffdraft.drafters.families import DraftModel, family_of, family_with_variant
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.dart_objective import DARTObjective, new_dart_drafter
from diffdraft.train.deer_objective import DEERObjective, new_deer_drafter
from diffdraft.train.objective import BlockObjective, new_block_drafter

Objective = nn.Module
"""A family's training objective: ``(batch, gamma) -> (loss, hits, agreements, counts)``, the last
three per drafted position."""


@dataclass(frozen=True)
class TrainingRecipe:
    """How one drafter family trains."""

    objective: Callable[[Any, nn.Module, int, int | None], Objective]
    """(drafter, the target's model, stage, max_suffix) -> its objective; stage and max_suffix pick
    a staged recipe's step (DEER's), the others ignore them."""
    new_model: Callable[[TrainConfig, TargetModel, torch.Tensor | None], DraftModel]
    """(the run's config, its target, the draft vocabulary or None) -> a fresh network to train."""
    gamma_0: float
    """The paper's loss position weighting where the run gives none."""
    fixed_gamma: bool
    """Whether gamma stays at gamma_0; else it rises 1 per epoch (DFlare's schedule)."""
    needs_mask_token: bool = True
    """Whether a new network needs a mask token id (DART learns its mask embeddings)."""
    reads_mask_as_text: bool = False
    """Whether the network reads the context's tokens, where a mask id that is also text would read as
    MASK: then training data must never contain it (DEER)."""


RECIPES: dict[str, TrainingRecipe] = {
    # DFlare's exp(-(k-1)/gamma), gamma rising 1 per epoch from 4.5
    DFLASH: TrainingRecipe(
        objective=lambda drafter, target_model, stage, max_suffix: BlockObjective(drafter, target_model),
        new_model=new_block_drafter,
        gamma_0=4.5,
        fixed_gamma=False,
    ),
    # DART's gamma ** (t-1), gamma fixed at 0.6 (its Table 4)
    DART: TrainingRecipe(
        objective=lambda drafter, target_model, stage, max_suffix: DARTObjective(drafter, target_model),
        new_model=new_dart_drafter,
        gamma_0=0.6,
        fixed_gamma=True,
        needs_mask_token=False,
    ),
    # DEER's stage-2 alpha ** (R-i), alpha fixed at 1.01 (its Fig. 6: 1.05 diverged)
    DEER: TrainingRecipe(
        objective=lambda drafter, target_model, stage, max_suffix: DEERObjective(drafter, stage, max_suffix),
        new_model=new_deer_drafter,
        gamma_0=1.01,
        fixed_gamma=True,
        reads_mask_as_text=True,
    ),
}
"""Every family's recipe, by family key (:attr:`~diffdraft.drafters.families.DrafterFamily.key`)."""


def recipe_for(drafter: DraftModel) -> TrainingRecipe:
    """The recipe of a draft network's family."""
    return RECIPES[family_of(drafter).key]


def recipe_for_variant(variant: str) -> TrainingRecipe:
    """The recipe of the family a variant name (``train fit --variant``) belongs to."""
    return RECIPES[family_with_variant(variant).key]


def make_objective(
    drafter: DraftModel, target_model: nn.Module, stage: int = 2, max_suffix: int | None = None
) -> Objective:
    """The module that turns one batch into (loss, hits, agreements, counts) for ``drafter``.

    ``stage`` and ``max_suffix`` pick a staged recipe's step (DEER's,
    :mod:`~diffdraft.train.deer_objective`); the defaults give inference-shaped blocks, what
    evaluation measures."""
    return recipe_for(drafter).objective(drafter, target_model, stage, max_suffix)
