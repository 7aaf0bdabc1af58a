"""Each family's training recipe: the objective, the fresh network and the loss weighting it asks for."""

from __future__ import annotations

import importlib

import pytest
import torch

from diffdraft.drafters.dart_model import DART
from diffdraft.drafters.deer_model import DEER
from diffdraft.drafters.dflash2_model import DFLASH2
from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.drafters.dspark_model import DSPARK
from diffdraft.drafters.families import FAMILIES, family_of, family_with_variant
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.dart_objective import DARTObjective
from diffdraft.train.deer_objective import DEERObjective
from diffdraft.train.dflash2_objective import SelectorObjective
from diffdraft.train.dflash_objective import BlockObjective
from diffdraft.train.dspark_objective import MarkovObjective
from diffdraft.train.objectives import family_recipe, make_objective, recipe_for, recipe_for_variant

from diffdraft_testing.targets import tiny_target


def test_every_family_diffdraft_trains_has_a_recipe_in_its_own_objective_module():
    trained = {key: family for key, family in FAMILIES.items() if family.trains}
    assert set(trained) == {"dflash", "dart", "deer", "dflash2", "dspark"}
    for key, family in trained.items():
        assert family_recipe(family) is importlib.import_module(f"diffdraft.train.{key}_objective").RECIPE


@pytest.mark.parametrize(
    ("variant", "objective", "gamma_0", "fixed"),
    [
        (DFLASH, BlockObjective, 4.5, False),
        (DFLARE, BlockObjective, 4.5, False),
        (DART, DARTObjective, 0.6, True),
        (DEER, DEERObjective, 1.01, True),
        (DFLASH2, SelectorObjective, 4.5, False),
        (DSPARK, MarkovObjective, 4.0, True),
    ],
)
def test_a_new_network_of_each_variant_gets_its_family_s_objective_and_weighting(
    variant, objective, gamma_0, fixed
):
    target = TargetModel(tiny_target("qwen3", dtype=torch.float32))
    config = TrainConfig("", variant=variant, num_layers=1, block_size=4, draft_length=3, mask_token_id=0)
    recipe = recipe_for_variant(variant)
    model = recipe.new_model(config, target, None)
    assert family_of(model) is family_with_variant(variant) and model.variant == variant
    assert recipe_for(model) is recipe
    assert (recipe.gamma_0, recipe.fixed_gamma) == (gamma_0, fixed)
    assert recipe.needs_mask_token == (variant != DART)
    assert recipe.reads_mask_as_text == (variant == DEER)
    made = make_objective(model, target.model, 1, 8)
    assert isinstance(made, objective)
    if variant == DEER:  # the staged recipe gets its stage
        assert (made.stage, made.max_suffix) == (1, 8)
        evaluation = make_objective(model, target.model)  # inference-shaped blocks
        assert (evaluation.stage, evaluation.max_suffix) == (2, None)
