"""The family registry: each family's record answers for it, and a new family is its own classes plus
one registry entry (a toy family, registered for one test, runs end to end); its training recipe is
found in its own objective module, by name."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

import diffdraft
from diffdraft.decoding.method_table import METHODS, Drafting, Method, TreeRule
from diffdraft.drafters.base import ForksByCopy, Proposal
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.families import (
    DART_FAMILY,
    DEER_FAMILY,
    DFLASH2_FAMILY,
    DFLASH_FAMILY,
    DSPARK_FAMILY,
    FAMILIES,
    DrafterFamily,
    family_of,
    family_of_config,
    family_with_variant,
    make_drafter,
    variants,
)
from diffdraft.errors import IncompatibleDrafterError, InvalidRequestError
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.objectives import make_objective, recipe_for, recipe_for_variant
from diffdraft.train.recipe import TrainingRecipe

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_dart, tiny_dflash2, tiny_drafter, tiny_dspark
from diffdraft_testing.targets import tiny_target

TOY = "toy"
TOY_ARCHITECTURE = "ToyDraftModel"
TOY_OBJECTIVE = "diffdraft.train.toy_objective"
"""Where training finds the toy family's recipe: ``diffdraft.train.<family key>_objective``."""


class ToyDraftModel(nn.Module):
    """A bigram table: the draft for each depth is the row of the token drafted before it."""

    variant = TOY

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_depth = config.block_size - 1
        self.target_layer_ids: list[int] = []
        self.draft_vocab = None
        self.bigram = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))


class ToyDrafter(ForksByCopy):
    def __init__(self, model: ToyDraftModel, target: TargetModel) -> None:
        check_toy(model, target)
        self.model = model
        self.max_depth = model.max_depth
        self.target_layer_ids: list[int] = []

    def reset(self) -> None:
        pass

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        rows, token = [], int(token_ids[-1])
        for _ in range(depth):
            rows.append(self.model.bigram[token].detach().float().log_softmax(-1))
            token = int(rows[-1].argmax())
        return Proposal(log_probs=torch.stack(rows))


def check_toy(model: ToyDraftModel, target: TargetModel) -> None:
    if model.config.vocab_size != target.vocab_size:
        raise IncompatibleDrafterError("the toy drafter belongs to another vocabulary")


TOY_FAMILY = DrafterFamily(
    name="Toy",
    variants=(TOY,),
    model=ToyDraftModel,
    claims=lambda raw: TOY_ARCHITECTURE in (raw.get("architectures") or []),
    read_config=lambda raw: PretrainedConfig(**raw),
    drafter=ToyDrafter,
    check_compatible=check_toy,
    made_by="the toy test",
)


class ToyObjective(nn.Module):
    """The toy's training objective; only what finding it needs (training a bigram is not tested here)."""

    def __init__(self, drafter: ToyDraftModel) -> None:
        super().__init__()
        self.drafter = drafter


def new_toy_model(run: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None) -> ToyDraftModel:
    config = PretrainedConfig(vocab_size=target.vocab_size, block_size=run.block_size)
    config.architectures = [TOY_ARCHITECTURE]
    return ToyDraftModel(config)


TOY_RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: ToyObjective(drafter),
    new_model=new_toy_model,
    gamma_0=1.0,
    fixed_gamma=True,
    needs_mask_token=False,
)


def toy_objective_module() -> ModuleType:
    """The toy family's own training file (a family ships it as ``train/toy_objective.py``): its RECIPE."""
    module = ModuleType(TOY_OBJECTIVE)
    module.RECIPE = TOY_RECIPE
    return module


@pytest.fixture
def toy_registered(monkeypatch):
    """The toy family: its own objects and training module, plus its one registry entry; and, as any
    method of its own would, a method row that takes its drafters only."""
    monkeypatch.setitem(sys.modules, TOY_OBJECTIVE, toy_objective_module())
    monkeypatch.setitem(FAMILIES, TOY, TOY_FAMILY)
    method = Method("toy-tree", Drafting.MODEL, TreeRule.DDTREE, family=TOY, default_budget=6)
    monkeypatch.setitem(METHODS, method.name, method)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")


def toy_model(loaded) -> ToyDraftModel:
    """A bigram table of the target's own next token after each single token, so drafts get accepted."""
    vocab = loaded.model.config.vocab_size
    model = ToyDraftModel(PretrainedConfig(architectures=[TOY_ARCHITECTURE], vocab_size=vocab, block_size=4))
    with torch.no_grad():
        model.bigram.copy_(loaded.model(torch.arange(vocab)[:, None]).logits[:, -1])
    return model


def test_a_registered_family_runs_end_to_end_token_identical_to_plain_decoding(
    toy_registered, checkpoint, tmp_path
):
    loaded = load_target(checkpoint, dtype="float32")
    target = TargetModel(loaded.model)
    save_draft_model(toy_model(loaded), tmp_path / "toy")
    model = load_draft_model(tmp_path / "toy")  # its config claims it
    assert isinstance(model, ToyDraftModel) and family_of(model) is TOY_FAMILY
    assert isinstance(make_drafter(model, target, loaded.tokenizer), ToyDrafter)
    assert TOY in variants() and family_with_variant(TOY) is TOY_FAMILY
    assert recipe_for(model) is TOY_RECIPE and recipe_for_variant(TOY) is TOY_RECIPE  # found by name
    assert isinstance(make_objective(model, loaded.model), ToyObjective)

    prompt = dict(prompt="hello world, the quick", max_new_tokens=16, ignore_eos=True)
    plain = diffdraft.SpeculativeGenerator(loaded, "ar").generate(**prompt)
    for method in ("toy-tree", "chain", "ddtree+pld"):  # its own method, and any drafter's
        result = diffdraft.SpeculativeGenerator(loaded, method, tmp_path / "toy", budget=6).generate(**prompt)
        assert result.token_ids == plain.token_ids, method
        assert result.stats.tau > 1.0, method  # its drafts were verified, and some accepted

    dflash = tiny_drafter(loaded.model).float()
    with pytest.raises(InvalidRequestError, match=r"method 'toy-tree' needs a Toy drafter \(the toy test\)"):
        diffdraft.SpeculativeGenerator(loaded, "toy-tree", dflash)
    with pytest.raises(
        InvalidRequestError, match="DFlash/DFlare, DART, DEER, DFlash2, DSpark or Toy checkpoint"
    ):
        diffdraft.SpeculativeGenerator(loaded, "toy-tree")


def test_without_its_registry_entry_a_family_is_nobody_s():
    model = ToyDraftModel(PretrainedConfig(vocab_size=8, block_size=2))
    with pytest.raises(TypeError, match="ToyDraftModel is the network of no registered drafter family"):
        family_of(model)
    assert family_of_config({"architectures": [TOY_ARCHITECTURE]}) is DFLASH_FAMILY  # the unclaimed default


def test_a_family_without_its_objective_module_says_which_module_it_needs(monkeypatch):
    monkeypatch.setitem(FAMILIES, TOY, TOY_FAMILY)
    missing = r"the Toy drafter family has no training recipe: its module diffdraft\.train\.toy_objective"
    with pytest.raises(ModuleNotFoundError, match=missing):
        recipe_for_variant(TOY)
    monkeypatch.setitem(sys.modules, TOY_OBJECTIVE, ModuleType(TOY_OBJECTIVE))
    with pytest.raises(TypeError, match=r"diffdraft\.train\.toy_objective defines no RECIPE"):
        recipe_for_variant(TOY)


def test_each_shipped_family_is_its_networks_and_configs_family():
    target = tiny_target("qwen3")
    models = {
        DFLASH_FAMILY: tiny_drafter(target),
        DART_FAMILY: tiny_dart(target),
        DEER_FAMILY: deer_from_causal_lm(target, 1, 4, 0, None, "test"),
        DFLASH2_FAMILY: tiny_dflash2(target),
        DSPARK_FAMILY: tiny_dspark(target),
    }
    drafters = {DFLASH_FAMILY: DFlashDrafter, DART_FAMILY: DARTDrafter, DEER_FAMILY: DEERDrafter}
    drafters |= {DFLASH2_FAMILY: DFlashDrafter, DSPARK_FAMILY: DFlashDrafter}  # DFlash's, other heads
    for family, model in models.items():
        assert family_of(model) is family
        assert family_of_config(model.config.to_dict()) is family
        assert family_with_variant(model.variant) is family
        assert isinstance(make_drafter(model, TargetModel(target)), drafters[family])
    assert family_of_config({"draft_length": 7}) is DART_FAMILY  # released DART configs name no architecture
    assert variants() == ["dflash", "dflare", "dart", "deer", "dflash2", "dspark"]
