"""The DFlash checkpoint both serving engines load, built from one of our drafters.

vLLM and SGLang read the same official DFlash layout (facts from their source, cited in
:mod:`diffdraft.export.vllm` and :mod:`diffdraft.export.sglang`): a Qwen3 ``config.json`` with
``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``, and the weights ``fc``, ``hidden_norm``,
``norm`` and ``layers.{i}.*``, with no embedding and no LM head (both take the target's). What
differs per engine (draft vocabulary, mask token text) lives in those modules. DFlash2 and DSpark
drafters build on this layout in :mod:`diffdraft.export.dflash2` and :mod:`diffdraft.export.dspark`.

Layer ids need no conversion: both engines read ``dflash_config.target_layer_ids`` in DFlash's own
convention (id ``i`` = output of decoder layer ``i``, our convention too) and add 1 themselves, because
they capture the residual stream *entering* a decoder layer (:func:`capture_point`). That rule has
one hole: the last layer's output is never the input of a layer, so an id of ``L - 1`` cannot be
served (diffdraft reads it after the final norm, as Hugging Face's ``hidden_states[L]``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from diffdraft.drafters.dflash_model import DFLARE, DFlashDraftModel
from diffdraft.drafters.dspark_model import ARCHITECTURES as DSPARK_ARCHITECTURES
from diffdraft.drafters.families import (
    DFLASH2_FAMILY,
    DFLASH_FAMILY,
    DSPARK_FAMILY,
    DraftModel,
    family_of,
)
from diffdraft.errors import ExportError
from diffdraft.target.loading import LoadedModel

ARCHITECTURE = "DFlashDraftModel"
"""The architecture name both engines map to their DFlash draft model."""
STALE_KEYS = (
    "target_layer_ids",
    "mask_token_id",
    "eagle_aux_hidden_state_layer_ids",
    "draft_vocab_size",
    "variant",
)
"""Top-level copies a source config may carry; the engines would read or cross-check them, so the
settings live in ``dflash_config`` only (vLLM's aux-layer ids would even override the taps)."""
SERVED_FAMILIES = (DFLASH_FAMILY, DFLASH2_FAMILY, DSPARK_FAMILY)
"""The families whose drafters some engine runs (each engine module says which it takes)."""


@dataclass
class Export:
    """What is written: ``config.json`` contents and the safetensors weights by name."""

    config: dict
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Engine:
    """One serving engine: its display name, how it wants the drafter, and how it is launched."""

    name: str
    build: Callable[[DraftModel, LoadedModel | None], Export]
    """Raises ExportError for what the engine cannot run; ``target`` is given with --target."""
    launch: Callable[[Path, dict, str], str]
    """The launch command for the exported directory, the written config and the target's path."""
    other_launch: Callable[[Path, dict, str], str] | None = None
    """Where a build of the engine does not start with ``launch``: a line naming the build, then the
    command that starts the same server there (same arguments)."""


def drafted_tokens(config: dict) -> int:
    """Tokens one block drafts, by the written config: ``block_size`` for a DSpark drafter whose anchor
    row predicts, ``block_size - 1`` otherwise (the anchor row is the committed token)."""
    block = int(config["block_size"])
    dspark = bool(set(config.get("architectures") or []) & set(DSPARK_ARCHITECTURES))
    return block if dspark and config.get("sample_from_anchor", True) else block - 1


def capture_point(layer_id: int) -> int:
    """The engines' capture index for a DFlash layer id: the input of decoder layer ``layer_id + 1``."""
    return layer_id + 1


def check_family(model: DraftModel, engine: str) -> DraftModel:
    """Refuse the drafters no DFlash-lineage serving path runs: DART, DEER and DFlare. DFlash, DFlash2
    and DSpark drafters pass; what an engine lacks for one of them its own module refuses."""
    family = family_of(model)
    if family not in SERVED_FAMILIES:
        raise ExportError(
            f"this is a {family.name} drafter; {engine} runs DFlash, DFlash2 and DSpark drafters only: "
            "export a drafter trained with diffdraft train fit --variant dflash, dflash2 or dspark"
        )
    if model.variant == DFLARE:
        raise ExportError(
            f"this is a DFlare drafter (per-layer softmax fusion of the taps and separate context K/V "
            f"projections); {engine}'s DFlash model has neither (one shared fc, context projected by each "
            "layer's own k/v): export a drafter trained with diffdraft train fit --variant dflash"
        )
    return model


def check_taps(model: DFlashDraftModel, engine: str, num_target_layers: int | None) -> None:
    """Refuse taps the engines cannot capture; ``num_target_layers`` None (unknown) checks nothing."""
    if num_target_layers is None:
        return
    last = num_target_layers - 1
    bad = [i for i in model.target_layer_ids if i < 0 or capture_point(i) > last]
    if bad:
        raise ExportError(
            f"target_layer_ids {bad} cannot be served: {engine} captures the input of layer id+1, and the "
            f"target's last layer ({last}) feeds no layer (diffdraft reads its output after the final "
            f"norm); retrain with ids in [0, {last - 1}] (diffdraft train fit --target-layer-ids)"
        )


def serving_config(model: DFlashDraftModel) -> dict:
    """The drafter's config in the official DFlash layout, with every field the engines read set.

    Attention is written out as what our network computes (every layer full and bidirectional:
    ``layer_types`` all ``full_attention``, no sliding window); RoPE is written both as transformers
    5's ``rope_parameters`` and as the 4.x ``rope_theta`` / ``rope_scaling`` an engine may still use.
    """
    config = model.config.to_dict()
    rope = dict(config.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        block_size=model.block_size,
        dflash_config={
            "mask_token_id": model.mask_token_id,
            "target_layer_ids": list(model.target_layer_ids),
        },
        layer_types=["full_attention"] * model.config.num_hidden_layers,
        use_sliding_window=False,
        sliding_window=None,
        rope_parameters=rope,
        rope_theta=rope.get("rope_theta", 10000.0),
        rope_scaling=None
        if rope.get("rope_type", "default") == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"},
        tie_word_embeddings=False,
        dtype=dtype,
        torch_dtype=dtype,
    )
    for key in STALE_KEYS:
        config.pop(key, None)
    if getattr(model.config, "num_target_layers", None) is not None:
        config["num_target_layers"] = model.config.num_target_layers
    return config


def serving_weights(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The network's weights under the official names (the draft vocabulary is engine business)."""
    return {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in model.state_dict().items()
        if name != "draft_vocab"
    }


def without_draft_vocabulary(model: DFlashDraftModel) -> DFlashDraftModel:
    """The same network scoring every row of the target's LM head instead of its draft vocabulary's
    (``export --full-vocabulary``): SGLang drafts over the whole head and cannot restrict it. Training
    ranked only the draft vocabulary's rows, so acceptance can change; ``diffdraft train eval``
    measures it (the shipped DFlash drafter's card has its figures)."""
    if model.draft_vocab is None:
        return model
    if family_of(model) is not DFLASH_FAMILY:
        raise ExportError(
            f"this {family_of(model).name} drafter drafts over a reduced vocabulary of "
            f"{model.draft_vocab.shape[0]} tokens with a head and Markov rows of its own, trained for those "
            "tokens only, so --full-vocabulary cannot drop it: export it without --full-vocabulary"
        )
    config = copy.deepcopy(model.config)
    config.dflash_config = {**config.dflash_config, "draft_vocab_size": 0}
    whole = DFlashDraftModel(config).to(next(model.parameters()).dtype)
    whole.load_state_dict({k: v for k, v in model.state_dict().items() if k != "draft_vocab"})
    return whole
