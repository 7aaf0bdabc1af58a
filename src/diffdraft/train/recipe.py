"""What a drafter family's training recipe holds: each family's own objective module
(``diffdraft.train.<family key>_objective``) defines one as its ``RECIPE``, and
:mod:`diffdraft.train.objectives` finds it there by that name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffdraft.drafters.families import DraftModel
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig

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
