"""Load a target model and its tokenizer from the embedded default, a local HF directory or a GGUF file.

Only local files are read (``local_files_only=True``): diffdraft never downloads, so a wrong path is
an error that says what to pass instead, never a silent hub lookup.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from diffdraft.errors import CheckpointError, InvalidRequestError
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.grouped_attention import use_grouped_attention
from diffdraft.kernels.huge_pages import block_weights_on_huge_pages
from diffdraft.kernels.packed_linear import pack_linear_layers
from diffdraft.kernels.quantized.gguf_weights import block_weights_supported, use_gguf_blocks
from diffdraft.kernels.quantized.kernel_build import block_kernel, cpu_supported
from diffdraft.target.attention_choice import attention_implementation
from diffdraft.target.default_model import MODEL_NAME, default_cache_dir, default_gguf_path
from diffdraft.target.gguf_cache import entry_dir, load_entry, save_entry
from diffdraft.target.gguf_file import check_gguf_file
from diffdraft.util.cache_digest import intact, sealed_directory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The names from_pretrained looks for; anything else in the directory is not loadable weights.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_WHAT_TO_PASS = "pass 'default', a local Hugging Face model directory, or a path to a .gguf file"
# A conversion takes well under a minute; temp dirs older than this were left by a killed one.
_STALE_SECONDS = 3600


@dataclass
class LoadedModel:
    """A target ready for inference, plus where it came from (for logs and bench reports)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str


def load_target(
    spec: str | os.PathLike,
    dtype: str = "auto",
    device: str | torch.device | None = None,
    optimize: bool = False,
    gguf_blocks: bool = True,
    block_activations: str = "int8",
) -> LoadedModel:
    """Load a causal LM in eval mode with SDPA attention (the tree-mask verifier needs SDPA).

    ``spec`` is ``"default"`` (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, or
    a ``.gguf`` file (dequantized to dense weights). ``dtype="auto"`` keeps the checkpoint's recorded
    dtype, except float16 on CPU and unrecorded dtypes, which become float32; a GGUF file (the default
    target included) loads in bfloat16 where the device computes it natively or its blocks run on
    diffdraft's kernels (:func:`gguf_dtype`), float32 elsewhere. ``optimize`` applies
    diffdraft's CPU inference kernels (:mod:`diffdraft.kernels.packed_linear`,
    :mod:`diffdraft.kernels.fused_projections`, :mod:`diffdraft.kernels.grouped_attention`, and the
    block kernels' weights on huge pages, :mod:`diffdraft.kernels.huge_pages`): identical
    logits in float32 (bfloat16: equal up to rounding), faster forwards, inference only. With ``optimize`` and
    ``gguf_blocks``, a bfloat16 target read from a GGUF (the default included) also keeps the GGUF's
    blocks for its linear layers and LM head where this CPU runs :mod:`diffdraft.kernels.quantized`'s
    kernels (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K: every tensor on its own format's kernel): the
    same weights, a third of the bytes per forward or less. ``block_activations`` picks those layers'
    kernel: "int8" (inputs quantized to int8 per block, as llama.cpp computes; the fastest) or "bf16"
    (exactly the dense bf16 model's weights and bf16 inputs; Q4_1 layers only, the head dense). A
    user's GGUF file on the block kernels is laid out once into the diffdraft cache
    (:mod:`diffdraft.target.gguf_cache`), so a later load of it reads the layout instead of
    dequantizing the file again.
    """
    given = None if str(spec) == "default" else Path(spec).expanduser()
    if given is not None and given.suffix.lower() == ".gguf" and given.is_file():
        check_gguf_file(given)  # first: a cut file fails at once, not after a kernel build or a slow load
    gguf = _gguf_file(spec) if optimize and gguf_blocks else None
    entry = _cache_entry(spec, gguf, dtype, device, block_activations)
    cached = None if entry is None else load_entry(entry, gguf, torch.bfloat16)
    if cached is not None:
        model, tokenizer, replaced = cached
        loaded = LoadedModel(model, tokenizer, f"GGUF file {gguf} (laid out from the cache at {entry})")
        loaded.source += f", {replaced} linear layers on its GGUF blocks ({block_activations} activations)"
    else:
        loaded = _load(spec, dtype, device)
    if optimize:
        usable = cached is None and gguf is not None and block_weights_supported(loaded.model)
        if usable and (placed := use_gguf_blocks(loaded.model, gguf, block_activations)):
            loaded.source += (
                f", {len(placed)} linear layers on its GGUF blocks ({block_activations} activations)"
            )
            if entry is not None:
                save_entry(entry, loaded.model, loaded.tokenizer, placed, block_activations)
        pack_linear_layers(loaded.model)
        fuse_projections(loaded.model)
        use_grouped_attention(loaded.model)
        block_weights_on_huge_pages(loaded.model)
    return loaded


def _cache_entry(
    spec: str | os.PathLike,
    gguf: Path | None,
    dtype: str,
    device: str | torch.device | None,
    activations: str,
) -> Path | None:
    """Where the layout of a GGUF file's target is cached (:mod:`diffdraft.target.gguf_cache`): a
    user's file (the default target has a cache of its own) loading in bfloat16 on this CPU's block
    kernels; None for any other load."""
    if gguf is None or str(spec) == "default" or not gguf.is_file():
        return None
    device = default_device(device)
    resolved = gguf_dtype(device) if dtype == "auto" else dtype
    if device.type != "cpu" or resolved != "bfloat16" or block_kernel() is None:
        return None
    return entry_dir(gguf, torch.bfloat16, activations)


def _gguf_file(spec: str | os.PathLike) -> Path | None:
    """The GGUF a target was read from: the default's, or ``spec`` itself when it is one."""
    if str(spec) == "default":
        return default_gguf_path()
    path = Path(spec).expanduser()
    return path if path.suffix.lower() == ".gguf" else None


def default_device(device: str | torch.device | None = None) -> torch.device:
    """``device``, or CUDA when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def native_bfloat16(device: str | torch.device) -> bool:
    """Whether ``device`` computes bfloat16 in hardware (CUDA with bf16, a CPU with AVX-512 BF16 or
    AMX): there bf16 trains far faster than float32; elsewhere it is emulated and slower
    (docs/decisions.md, "training precision follows the device")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, so probed with care
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def fastest_dtype(device: str | torch.device) -> str:
    """ "bfloat16" where :func:`native_bfloat16`, else "float32"."""
    return "bfloat16" if native_bfloat16(device) else "float32"


def gguf_dtype(device: str | torch.device) -> str:
    """The dtype a GGUF target loads in by default: bfloat16 where the device computes it natively or
    where this CPU runs diffdraft's block kernels, which keep the file's quantized blocks and take
    bfloat16 inputs (on an AVX2 CPU without native bfloat16 they decoded far faster than dense float32:
    docs/decisions.md, "AVX-512 kernels emulated on AVX2"), else float32."""
    device = torch.device(device)
    return "bfloat16" if native_bfloat16(device) or (device.type == "cpu" and cpu_supported()) else "float32"


def _load(spec: str | os.PathLike, dtype: str, device: str | torch.device | None) -> LoadedModel:
    if dtype != "auto" and dtype not in DTYPES:
        raise InvalidRequestError(
            f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}; got {dtype!r}"
        )
    device = default_device(device)
    gguf_made = str(spec) == "default" or Path(spec).suffix.lower() == ".gguf"
    if dtype == "auto" and gguf_made:
        dtype = gguf_dtype(device)  # a GGUF records no dtype
    if str(spec) == "default":
        path = default_model_dir()
        loaded = _load_directory(path, dtype, device)
        loaded.source = f"embedded default {MODEL_NAME} (cached at {path})"
        return loaded
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist. diffdraft only loads local files: {_WHAT_TO_PASS} "
            "(download a hub model to a directory first, then pass that directory)."
        )
    if path.is_dir():
        return _load_directory(path, dtype, device)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, device)
    raise CheckpointError(
        f"{path} is a file but not a .gguf file. For safetensors or .bin weights pass the directory that "
        f"holds them together with config.json and the tokenizer files; otherwise {_WHAT_TO_PASS}."
    )


def default_model_dir() -> Path:
    """The default target as a Hugging Face directory, converting its GGUF on first use.

    Dequantizing the GGUF is slow on every load, while a safetensors directory loads at once
    (docs/decisions.md, "a GGUF target's layout cached once"), so the GGUF is converted once into the
    user cache and later loads read the cache. The
    weights are kept in float32, which holds the dequantized values exactly, so the cache computes the
    same logits as the GGUF. Every load checks the cache's digests first
    (:mod:`diffdraft.util.cache_digest`): a damaged, incomplete or half-written copy is converted again.
    """
    gguf = default_gguf_path()
    target = default_cache_dir()
    if not intact(target, "the cached default target", "converting again"):
        _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    """Write into a temp dir, sealed with its digests, and rename it over whatever ``target`` held, so a
    killed conversion never leaves a half cache and a broken one is replaced whole."""
    print(f"diffdraft: converting {MODEL_NAME} GGUF to safetensors in {target} (once) ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)
    with sealed_directory(target) as staging:
        loaded = load_target(gguf, dtype="float32", device="cpu")
        loaded.model.save_pretrained(staging)
        loaded.tokenizer.save_pretrained(staging)


def end_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends generation: chat models often have several (<|im_end|>, <|endoftext|>)."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (
        getattr(generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.update(int(v) for v in values if v is not None)
    return sorted(ids)


def _resolve_dtype(dtype: str, recorded: object, device: torch.device) -> torch.dtype:
    """Pick the load dtype; float16 on CPU is slow and lacks kernels, so "auto" avoids it there."""
    if dtype != "auto":
        return DTYPES[dtype]
    # Configs record the dtype as a torch.dtype or a string such as "bfloat16".
    chosen = DTYPES.get(str(recorded).removeprefix("torch."), torch.float32)
    if chosen == torch.float16 and device.type == "cpu":
        return torch.float32
    return chosen


def _load_directory(path: Path, dtype: str, device: torch.device) -> LoadedModel:
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} has no config.json, so it is not a Hugging Face model directory. Pass the directory "
            f"that save_pretrained wrote (config.json, weights, tokenizer files), or {_WHAT_TO_PASS}."
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(
            f"{path} has config.json but no weights (expected one of {', '.join(WEIGHT_FILES)}). "
            "Copy the model's weight files into this directory."
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except ValueError as error:
        raise CheckpointError(
            f"{path}: unsupported architecture: {str(error).splitlines()[0]} "
            "Use a decoder-only model this transformers version supports (e.g. Llama, Qwen2, Qwen3)."
        ) from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read config.json ({error}). Restore the file.") from error
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CheckpointError(
            f"{path}: unsupported architecture: model type {config.model_type!r} is not a causal language "
            "model. diffdraft needs a decoder-only target such as Llama, Qwen2 or Qwen3."
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=_resolve_dtype(dtype, config.dtype, device),
            device_map=device,
            attn_implementation=attention_implementation(config),
            local_files_only=True,
        )
    except SafetensorError as error:
        raise CheckpointError(
            f"{path}: the safetensors weights are corrupt or truncated ({error}). "
            "Download or save the weights again."
        ) from error
    return LoadedModel(model.eval(), _load_tokenizer(path), f"Hugging Face directory {path}")


def _load_tokenizer(path: Path, **kwargs: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except (ValueError, OSError) as error:
        raise CheckpointError(
            f"{path}: cannot load a tokenizer ({str(error).splitlines()[0]}). Put the model's tokenizer "
            "files (tokenizer.json, tokenizer_config.json) next to its weights."
        ) from error


def _load_gguf(path: Path, dtype: str, device: torch.device) -> LoadedModel:
    # Dequantize to plain nn.Linear weights: the engine needs ordinary modules and SDPA attention, and
    # a model still tied to a GGUF quantizer cannot be saved with save_pretrained.
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=_resolve_dtype(dtype, None, device),
            device_map=device,
            attn_implementation="sdpa",
            local_files_only=True,
        )
    except (ValueError, OSError) as error:
        raise CheckpointError(
            f"{path}: cannot load this GGUF file ({str(error).splitlines()[0]}). Pass an intact GGUF of an "
            "architecture transformers can read (e.g. Llama, Qwen2, Qwen3), or a Hugging Face directory."
        ) from error
    tokenizer = _load_tokenizer(path.parent, gguf_file=path.name)
    return LoadedModel(model.eval(), tokenizer, f"GGUF file {path} (dequantized)")
