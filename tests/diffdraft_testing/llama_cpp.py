"""llama.cpp's own binaries, for the tests that run an exported drafter in llama.cpp: found through
``$DIFFDRAFT_LLAMA_CPP_BIN`` or ``PATH``, never at a path of one machine; and the GGUF files the
export tests write and read."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, GGUFWriter

BIN_VARIABLE = "DIFFDRAFT_LLAMA_CPP_BIN"
"""Names the folder of llama.cpp's binaries (its ``build/bin``); without it they are looked up on PATH."""


def llama_cpp_binary(name: str) -> Path:
    """The llama.cpp binary ``name`` (e.g. ``llama-speculative-simple``) in ``$DIFFDRAFT_LLAMA_CPP_BIN``
    or, without that variable, on PATH; the calling test skips, saying how to make it run, if none is."""
    folder = os.environ.get(BIN_VARIABLE)
    found = Path(folder, name) if folder else shutil.which(name)
    if found is None or not Path(found).is_file():
        where = f"in {BIN_VARIABLE}={folder}" if folder else "on PATH"
        pytest.skip(f"no {name} {where}: build llama.cpp and put its bin folder on PATH or in {BIN_VARIABLE}")
    return Path(found)


def write_target_gguf(path: Path, target: torch.nn.Module, arch: str = "llama") -> Path:
    """The metadata this export reads from a target GGUF: architecture, depth, width, a BPE tokenizer
    of the target's vocabulary, and its LM head."""
    config = target.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_merges(["t 1"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(config.vocab_size - 1)
    writer.add_tensor("output.weight", target.lm_head.weight.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf(path: Path) -> tuple[dict, dict]:
    """A GGUF file's metadata (key -> value, less the ``GGUF.*`` header fields) and tensors by name."""
    reader = GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}
