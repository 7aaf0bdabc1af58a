"""Reading and writing drafter checkpoints: DFlash / DFlare in the official DFlash layout, DART
in the released DART layout, DEER in its base LM's layout.

A checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or index-sharded
``model-0000x-of-0000y.safetensors``). DFlash: a Qwen3 config plus ``block_size``,
``num_target_layers`` and ``dflash_config`` (``variant`` names DFlare when used); official
checkpoints load unchanged. DART: a Llama config plus ``draft_length`` and ``draft_vocab_size``
(see :mod:`diffdraft.drafters.dart_model`). DEER: the base LM's config with ``architectures:
["DEERDraftModel"]`` and ``deer_config`` (see :mod:`diffdraft.drafters.deer_model`). DFlash2 and
Qwen3 DSpark: the layouts vLLM loads, unchanged (:mod:`diffdraft.drafters.dflash2_model`,
:mod:`diffdraft.drafters.dspark_model`). Which family a
config is, and how it is read, each family's record says (:mod:`diffdraft.drafters.families`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from diffdraft.drafters.families import DrafterFamily, DraftModel, family_of_config
from diffdraft.errors import CheckpointError

DEFAULT_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "default_drafter"
"""The drafter shipped for the embedded default target (SmolLM2-135M-Instruct); see its README."""
DEFAULT_DART_DIR = Path(__file__).resolve().parent.parent / "default_dart"
"""The DART drafter shipped for the embedded default target; see its README."""
DEFAULT_DFLASH_DIR = Path(__file__).resolve().parent.parent / "default_dflash"
"""The DFlash drafter shipped for the default target, the one other engines run; see its README."""
DEFAULT_DEER_DIR = Path(__file__).resolve().parent.parent / "default_deer"
"""The DEER drafter shipped for the embedded default target; see its README."""
IGNORED_WEIGHTS = {"embed_tokens.weight", "t2d"}
"""Weights a checkpoint may carry that its network does not read, dropped where it has none of that
name: a copy of the target's embedding (released DART checkpoints; the drafter always borrows the
target's), and DSpark's training-only ``t2d`` (DART's network keeps its own ``t2d``)."""
WEIGHTS_NAME = "model.safetensors"
MASK_EMBEDDING_NAME = "mask_embedding.pt"
INDEX_NAME = "model.safetensors.index.json"


def resolve_drafter_path(spec: str | os.PathLike) -> Path:
    """``"default"`` / ``"default-dflash"`` / ``"default-dart"`` / ``"default-deer"`` -> a drafter
    shipped for the default target; anything else is a directory path."""
    shipped = {
        "default": DEFAULT_DRAFTER_DIR,
        "default-dflash": DEFAULT_DFLASH_DIR,
        "default-dart": DEFAULT_DART_DIR,
        "default-deer": DEFAULT_DEER_DIR,
    }.get(str(spec))
    if shipped is None:
        return Path(spec)
    if not (shipped / "config.json").is_file():
        raise CheckpointError(
            f"the {spec} drafter is missing from this installation ({shipped}): reinstall "
            "diffdraft, pass a drafter checkpoint directory, or use --method ar or pld"
        )
    return shipped


def read_draft_config(path: Path) -> tuple[DrafterFamily, PretrainedConfig]:
    """The family a checkpoint's ``config.json`` says it is, and the config read the family's way."""
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"drafter checkpoint {path} does not exist or is not a directory")
    if not config_file.is_file():
        raise CheckpointError(
            f"drafter checkpoint {path} has no config.json: is this a DFlash drafter directory?"
        )
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({err}); re-export or re-download it"
        ) from err
    family = family_of_config(raw)
    try:
        return family, family.read_config(raw)
    except Exception as err:  # transformers raises several validation error types
        raise CheckpointError(f"{config_file} is not a consistent drafter config: {err}") from err


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        index = json.loads((path / INDEX_NAME).read_text())
        files = [path / name for name in sorted(set(index["weight_map"].values()))]
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"drafter checkpoint {path} is missing its weights file {file.name}")
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"drafter weights {file} are corrupt or truncated ({err}); re-copy or re-train the checkpoint"
            ) from err
    return weights


def load_draft_model(path: str | os.PathLike) -> DraftModel:
    """Build the draft network from a checkpoint directory (or a shipped name), checking every weight."""
    path = resolve_drafter_path(path)
    family, config = read_draft_config(path)
    if (path / MASK_EMBEDDING_NAME).is_file():
        raise CheckpointError(
            f"drafter checkpoint {path} ships {MASK_EMBEDDING_NAME}, a mask-token embedding vLLM puts in "
            "place of the mask token's row; diffdraft does not, and would draft other distributions"
        )
    try:
        model = family.model(config)
    except ValueError as err:
        raise CheckpointError(f"drafter checkpoint {path} has an unusable config: {err}") from err
    weights = _read_weights(path)
    if family.fit_to_weights is not None:
        family.fit_to_weights(model, set(weights))
    expected = set(model.state_dict())
    weights = {k: v for k, v in weights.items() if k in expected or k not in IGNORED_WEIGHTS}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        kind = f"variant {model.variant!r}"
        raise CheckpointError(
            f"drafter checkpoint {path} does not match its config ({kind}): "
            f"missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
        )
    dtype = next(w.dtype for w in weights.values() if w.is_floating_point())
    model.to(dtype).load_state_dict(weights)
    return model


def save_draft_model(model: DraftModel, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` in its family's layout (optionally cast, e.g. to bfloat16 for shipping)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in model.state_dict().items()
    }
    config = model.config.to_dict()
    config["dtype"] = str(next(v.dtype for v in state.values() if v.is_floating_point())).removeprefix(
        "torch."
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, path / WEIGHTS_NAME, metadata={"format": "pt"})
