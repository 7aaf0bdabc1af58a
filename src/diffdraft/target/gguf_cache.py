"""A GGUF target laid out once: later loads of the same file read the cache, not the dense detour.

Loading a GGUF through transformers dequantizes every tensor into a dense model, on every load, and
putting its linear layers back on their blocks lays every tensor out for the int8 kernel again: for a
file of a billion parameters, minutes on a small CPU (docs/decisions.md, "a GGUF target's layout
cached once").
The first load of a file on block kernels saves what those steps made that the file cannot give
cheaply: the config, generation config and tokenizer, every tensor that stays dense (embeddings,
norms, biases, buffers) and the kernel's tiles. A later load builds the model on the meta device,
reads those back and takes the blocks themselves from the file again (a memory map), so it computes
what the first load's model computes.

An entry is keyed by the file's resolved path, size and modification time, the kernel library (its
sources and flags), the transformers version, the dtype and the layers' kernel: any change makes a
new entry, and a stale or broken one is rebuilt, never half read: every load checks the entry's
digests first (:mod:`diffdraft.util.cache_digest`), so a damaged tile or dense tensor is found before
its bytes reach the model.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from itertools import chain
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear
from diffdraft.kernels.quantized.gguf_weights import Placement, place_blocks
from diffdraft.kernels.quantized.kernel_build import library_key
from diffdraft.target.attention_choice import attention_implementation
from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import problem, sealed_directory

CACHE_VERSION = 1
"""Bumped when what an entry holds changes."""
LAYOUT = "layout.json"
"""The entry's index: which layers lie on which blocks."""


def entry_dir(gguf: Path, dtype: torch.dtype, activations: str) -> Path:
    """Where the cache keeps ``gguf``'s layout for ``dtype`` and the ``activations`` kernel."""
    stat = gguf.stat()
    key = [CACHE_VERSION, str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, library_key()]
    key += [transformers.__version__, str(dtype), activations]
    digest = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{digest}"


def save_entry(
    entry: Path, model: PreTrainedModel, tokenizer, placements: list[Placement], activations: str
) -> None:
    """Write ``model`` (just put on ``placements`` by ``use_gguf_blocks``) into ``entry``. A cache that
    cannot be written (a full disk, a read-only cache) costs only the speed of later loads: one stderr
    line says so, and the model loaded stays as it is."""
    try:
        _write_entry(entry, model, tokenizer, placements, activations)
    except (OSError, SafetensorError) as error:
        print(
            f"diffdraft: could not cache the layout at {entry} ({error}); later loads read the file again.",
            file=sys.stderr,
        )
        return
    print(f"diffdraft: cached the layout at {entry}; later loads of this file read it.", file=sys.stderr)


def _write_entry(
    entry: Path, model: PreTrainedModel, tokenizer, placements: list[Placement], activations: str
) -> None:
    with sealed_directory(entry) as staging:
        model.config.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        dense: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        first_name: dict[int, str] = {}
        named = chain(
            model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
        )
        for name, tensor in named:
            if id(tensor) in first_name:  # a tied weight: saved once
                aliases[name] = first_name[id(tensor)]
                continue
            first_name[id(tensor)] = name
            dense[name] = tensor.detach().contiguous()
        save_file(dense, staging / "dense.safetensors")
        tiles = {}
        for placement in placements:
            operands = model.get_submodule(placement.module).int8_operands()
            if operands is not None:
                tiles[placement.module] = operands[0]
        save_file(tiles, staging / "tiles.safetensors")
        index = {
            "placements": [asdict(p) for p in placements],
            "aliases": aliases,
            "activations": activations,
        }
        (staging / LAYOUT).write_text(json.dumps(index))


def load_entry(entry: Path, gguf: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, object, int] | None:
    """(model, tokenizer, layers on blocks) from an intact ``entry`` of ``gguf``; None, with one
    stderr line, where the entry is missing, fails its check or cannot be read (the caller loads the
    file anew, which writes the entry again)."""
    if not entry.exists():
        return None
    found = problem(entry)
    if found is not None:
        _cannot_read(entry, gguf, found)
        return None
    try:
        index = json.loads((entry / LAYOUT).read_text())
        placements = [Placement(**fields) for fields in index["placements"]]
        config = AutoConfig.from_pretrained(entry, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=attention_implementation(config)
            )
        dense = load_file(entry / "dense.safetensors")
        biases = {p.module: dense[f"{p.module}.bias"] for p in placements if f"{p.module}.bias" in dense}
        place_blocks(
            model, gguf, placements, index["activations"], biases, load_file(entry / "tiles.safetensors")
        )
        _assign(model, dense, index["aliases"])
        if (entry / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(entry, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as error:
        _cannot_read(entry, gguf, str(error))
        return None
    return model.eval(), tokenizer, len(placements)


def _cannot_read(entry: Path, gguf: Path, why: str) -> None:
    print(
        f"diffdraft: cannot read the cached layout at {entry} ({why}); loading {gguf.name} anew.",
        file=sys.stderr,
    )


def _assign(model: torch.nn.Module, dense: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Every parameter and buffer still on the meta device from ``dense`` (a tied one shares its first
    name's tensor); refuses a model left with any on the meta device."""
    made: dict[str, torch.Tensor] = {}
    for name in [*dense, *aliases]:
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        source = aliases.get(name, name)
        if attribute in module._parameters:
            if isinstance(module, BlockQuantizedLinear) and attribute == "bias":
                continue  # placed with its layer
            if source not in made:
                made[source] = torch.nn.Parameter(dense[source], requires_grad=False)
            module._parameters[attribute] = made[source]
        else:
            module._buffers[attribute] = dense[source]
    left = [name for name, tensor in chain(model.named_parameters(), model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"the cache holds no values for {', '.join(left[:3])}")
