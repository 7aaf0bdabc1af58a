"""One record per drafter family (DFlash/DFlare, DART, DEER, and DFlash2 and Qwen3 DSpark in the
layouts vLLM loads): how a checkpoint's config says it is
the family's, which network it builds, which drafter runs it and what it must fit. Everything that
needs to know a family asks this registry (training asks :mod:`diffdraft.train.objectives`, which
finds the family's recipe in its own ``diffdraft.train.<key>_objective`` by name), so a new family is
its own files plus one entry here, and no ``isinstance`` elsewhere learns its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from diffdraft.drafters import dart, deer, dflash
from diffdraft.drafters.base import Drafter
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.dart_model import DART, DARTDraftModel, dart_config_from, is_dart_config
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import DEER, DEERDraftModel, deer_config_from, is_deer_config
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash2_model import (
    DFLASH2,
    DFlash2DraftModel,
    dflash2_config_from,
    is_dflash2_config,
)
from diffdraft.drafters.dflash_model import DFLARE, DFLASH, DFlashDraftModel, dflash_config_from
from diffdraft.drafters.dspark_model import DSPARK, DSparkDraftModel, dspark_config_from, is_dspark_config
from diffdraft.target.model import TargetModel

DraftModel = nn.Module
"""A draft network of any registered family. Each has ``config``, ``variant`` (one of its family's
variants), ``target_layer_ids``, ``max_depth`` and ``draft_vocab`` (None: the whole vocabulary)."""


@dataclass(frozen=True)
class DrafterFamily:
    """What makes a drafter family, in one place."""

    name: str
    """How messages name the family."""
    variants: tuple[str, ...]
    """The ``variant`` names its networks report (``train fit --variant``); the first is its key."""
    model: type[nn.Module]
    """The draft network, built from the config :attr:`read_config` gives."""
    claims: Callable[[dict], bool] | None
    """Whether a raw ``config.json`` is this family's. None: the family of a config no other claims
    (DFlash: official checkpoints carry nothing of ours to tell them by)."""
    read_config: Callable[[dict], PretrainedConfig]
    """A raw ``config.json`` -> the config :attr:`model` takes; raises on an inconsistent one."""
    drafter: Callable[[Any, TargetModel], Drafter]
    """The runtime :class:`~diffdraft.drafters.base.Drafter` over a network and its target."""
    check_compatible: Callable[[Any, TargetModel], None]
    """Raises :class:`~diffdraft.errors.IncompatibleDrafterError` for a network made for another target."""
    made_by: str
    """The command that makes one, for messages that ask for one."""
    check_tokenizer: Callable[[Any, Any], None] | None = None
    """For a family that reads token ids only, where equal vocabulary sizes are not enough: raises
    :class:`~diffdraft.errors.IncompatibleDrafterError` for a network built with another tokenizer."""
    fit_to_weights: Callable[[Any, set[str]], None] | None = None
    """For a layout whose config does not say which optional weights it ships: called with the
    network and its checkpoint's weight names before they load, to grow those parts (DSpark's own
    head). None: the config says everything."""
    trains: bool = True
    """Whether diffdraft trains it (``train fit --variant``); False for a layout it would load and
    draft with only (every registered family trains now)."""

    @property
    def key(self) -> str:
        """The family's name in registries (:data:`FAMILIES`, the training recipes, method rows)."""
        return self.variants[0]


DFLASH_FAMILY = DrafterFamily(
    name="DFlash/DFlare",
    variants=(DFLASH, DFLARE),
    model=DFlashDraftModel,
    claims=None,
    read_config=dflash_config_from,
    drafter=DFlashDrafter,
    check_compatible=dflash.check_compatible,
    made_by="diffdraft train fit --variant dflash|dflare",
)
DART_FAMILY = DrafterFamily(
    name="DART",
    variants=(DART,),
    model=DARTDraftModel,
    claims=is_dart_config,
    read_config=dart_config_from,
    drafter=DARTDrafter,
    check_compatible=dart.check_compatible,
    made_by="diffdraft train fit --variant dart",
)
DEER_FAMILY = DrafterFamily(
    name="DEER",
    variants=(DEER,),
    model=DEERDraftModel,
    claims=is_deer_config,
    read_config=deer_config_from,
    drafter=DEERDrafter,
    check_compatible=deer.check_compatible,
    made_by="diffdraft deer init / train fit --variant deer",
    check_tokenizer=deer.check_tokenizer,
)
DFLASH2_FAMILY = DrafterFamily(
    name="DFlash2",
    variants=(DFLASH2,),
    model=DFlash2DraftModel,
    claims=is_dflash2_config,
    read_config=dflash2_config_from,
    drafter=DFlashDrafter,
    check_compatible=dflash.check_compatible,
    made_by="diffdraft train fit --variant dflash2",
)
DSPARK_FAMILY = DrafterFamily(
    name="DSpark",
    variants=(DSPARK,),
    model=DSparkDraftModel,
    claims=is_dspark_config,
    read_config=dspark_config_from,
    drafter=DFlashDrafter,
    check_compatible=dflash.check_compatible,
    made_by="diffdraft train fit --variant dspark",
    fit_to_weights=DSparkDraftModel.use_shipped_head,
)

FAMILIES: dict[str, DrafterFamily] = {
    f.key: f for f in (DFLASH_FAMILY, DART_FAMILY, DEER_FAMILY, DFLASH2_FAMILY, DSPARK_FAMILY)
}
"""Every family by key; a config is read as the first family here that claims it."""


def family_of(model: DraftModel) -> DrafterFamily:
    """The family of a draft network: the one whose network class is the most derived of those it
    is an instance of (DFlash2 and DSpark networks are DFlash networks too)."""
    matching = [family for family in FAMILIES.values() if isinstance(model, family.model)]
    if not matching:
        raise TypeError(f"{type(model).__name__} is the network of no registered drafter family")
    return max(matching, key=lambda family: len(family.model.__mro__))


def family_of_config(raw: dict) -> DrafterFamily:
    """The family a raw ``config.json`` says it is."""
    claimed = [f for f in FAMILIES.values() if f.claims is not None and f.claims(raw)]
    return claimed[0] if claimed else next(f for f in FAMILIES.values() if f.claims is None)


def variants() -> list[str]:
    """Every trained family's variants, the names ``train fit --variant`` takes."""
    return [variant for family in FAMILIES.values() if family.trains for variant in family.variants]


def family_with_variant(variant: str) -> DrafterFamily:
    """The family a variant name belongs to (the names :func:`variants` lists)."""
    return next(f for f in FAMILIES.values() if variant in f.variants)


def make_drafter(model: DraftModel, target: TargetModel, tokenizer: Any = None) -> Drafter:
    """The drafter for a draft network.

    With ``tokenizer`` (the target's), a family that reads token ids only also checks the network
    against it (:attr:`DrafterFamily.check_tokenizer`)."""
    family = family_of(model)
    if tokenizer is not None and family.check_tokenizer is not None:
        family.check_tokenizer(model, tokenizer)
    return family.drafter(model, target)


def check_compatible(model: DraftModel, target: TargetModel) -> None:
    """Raise :class:`~diffdraft.errors.IncompatibleDrafterError` if ``model`` was made for another target."""
    family_of(model).check_compatible(model, target)
