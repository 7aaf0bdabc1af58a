"""Each drafter family's training recipe: the training side of its record in
:mod:`diffdraft.drafters.families` (kept in train/, so drafters/ never imports train/). The trainer,
the evaluation and ``train fit`` ask the recipe instead of the family's name. A family's recipe is
the ``RECIPE`` (a :class:`~diffdraft.train.recipe.TrainingRecipe`) of its own objective module,
``diffdraft.train.<family key>_objective``, found by that name: a new family adds no entry here.
"""

from __future__ import annotations

import importlib

from torch import nn

from diffdraft.drafters.families import DrafterFamily, DraftModel, family_of, family_with_variant
from diffdraft.train.recipe import Objective, TrainingRecipe

RECIPE_MODULE = "diffdraft.train.{key}_objective"
"""Where a family's recipe is, by family key (:attr:`~diffdraft.drafters.families.DrafterFamily.key`):
that module's ``RECIPE``."""


def family_recipe(family: DrafterFamily) -> TrainingRecipe:
    """A family's recipe, the ``RECIPE`` of its objective module (:data:`RECIPE_MODULE`), imported the
    first time it is asked for. Raises ModuleNotFoundError naming the module a family without one
    lacks, and TypeError when that module's ``RECIPE`` is missing or not a recipe."""
    name = RECIPE_MODULE.format(key=family.key)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:  # the module is there, and something it imports is not
            raise
        raise ModuleNotFoundError(
            f"the {family.name} drafter family has no training recipe: its module {name} is missing "
            "(it defines the family's RECIPE, a diffdraft.train.recipe.TrainingRecipe)",
            name=name,
        ) from None
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, TrainingRecipe):
        raise TypeError(f"{name} defines no RECIPE (a TrainingRecipe) for the {family.name} drafter family")
    return recipe


def recipe_for(drafter: DraftModel) -> TrainingRecipe:
    """The recipe of a draft network's family."""
    return family_recipe(family_of(drafter))


def recipe_for_variant(variant: str) -> TrainingRecipe:
    """The recipe of the family a variant name (``train fit --variant``) belongs to."""
    return family_recipe(family_with_variant(variant))


def make_objective(
    drafter: DraftModel, target_model: nn.Module, stage: int = 2, max_suffix: int | None = None
) -> Objective:
    """The module that turns one batch into (loss, hits, agreements, counts) for ``drafter``.

    ``stage`` and ``max_suffix`` pick a staged recipe's step (DEER's,
    :mod:`~diffdraft.train.deer_objective`); the defaults give inference-shaped blocks, what
    evaluation measures."""
    return recipe_for(drafter).objective(drafter, target_model, stage, max_suffix)
