"""A GGUF target's cached layout: a later load computes what the first load's model computes."""

from __future__ import annotations

import os

import pytest
import torch

from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear, block_kernels
from diffdraft.kernels.quantized.gguf_weights import use_gguf_blocks
from diffdraft.target import gguf_cache
from diffdraft.target.gguf_cache import entry_dir, load_entry, save_entry

from diffdraft_testing.checkpoints import tiny_tokenizer
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import write_random_gguf
from diffdraft_testing.targets import tiny_target

FORMATS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q8_0"}
"""ffn_up and ffn_down stay dense (F32 in the file): the cache keeps dense layers too."""


def _placed(tmp_path):
    model = tiny_target("qwen2", seed=2, vocab=300, hidden=256, layers=2, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: saved once, shared again on load
    gguf = tmp_path / "target.gguf"
    write_random_gguf(gguf, model, FORMATS)
    placements = use_gguf_blocks(model, gguf)
    return model, gguf, placements


@needs_block_kernel
def test_a_cached_layout_loads_the_same_model_and_the_same_logits(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "cache")
    model, gguf, placements = _placed(tmp_path)
    entry = entry_dir(gguf, torch.bfloat16, "int8")
    save_entry(entry, model, tiny_tokenizer(), placements, "int8")
    loaded, tokenizer, replaced = load_entry(entry, gguf, torch.bfloat16)
    assert replaced == len(placements) == 5 * 2
    assert (
        block_kernels(loaded) == block_kernels(model) == ["Q4_K/int8", "Q5_0/int8", "Q6_K/int8", "Q8_0/int8"]
    )
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    text = "hello world, the quick brown fox"
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids
    for name, layer in model.named_modules():
        if isinstance(layer, BlockQuantizedLinear):
            twin = loaded.get_submodule(name)
            assert torch.equal(twin.int8_operands()[0], layer.int8_operands()[0])
            assert torch.equal(twin.weight, layer.weight)
    ids = torch.tensor([[5, 17, 3, 250, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@needs_block_kernel
def test_a_changed_file_gets_a_new_entry_and_a_broken_one_is_loaded_anew(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "cache")
    model, gguf, placements = _placed(tmp_path)
    entry = entry_dir(gguf, torch.bfloat16, "int8")
    assert entry_dir(gguf, torch.bfloat16, "bf16") != entry
    assert load_entry(entry, gguf, torch.bfloat16) is None  # nothing cached yet: silent
    save_entry(entry, model, tiny_tokenizer(), placements, "int8")
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert entry_dir(gguf, torch.bfloat16, "int8") != entry
    (entry / "tiles.safetensors").write_bytes(b"cut short")
    assert load_entry(entry, gguf, torch.bfloat16) is None
    assert f"cannot read the cached layout at {entry}" in capsys.readouterr().err


@needs_block_kernel
def test_a_cache_that_cannot_be_written_says_so_and_keeps_the_model(tmp_path, monkeypatch, capsys):
    model, gguf, placements = _placed(tmp_path)
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "cache")
    entry = entry_dir(gguf, torch.bfloat16, "int8")
    save_entry(entry, model, tiny_tokenizer(), placements, "int8")
    assert f"could not cache the layout at {entry}" in capsys.readouterr().err
    assert not entry.exists() and isinstance(model.model.layers[0].self_attn.q_proj, BlockQuantizedLinear)


@needs_block_kernel
@pytest.mark.real_model
def test_a_second_load_of_a_gguf_file_reads_its_cached_layout(tmp_path, monkeypatch):
    from diffdraft.target.default_model import default_gguf_path
    from diffdraft.target.loading import load_target
    from diffdraft.util.fingerprint import tokenizer_fingerprint

    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path)  # kernels keep their cache
    first = load_target(default_gguf_path(), optimize=True)
    second = load_target(default_gguf_path(), optimize=True)
    assert "(dequantized)" in first.source and "laid out from the cache at" in second.source
    assert "211 linear layers on its GGUF blocks" in second.source
    assert tokenizer_fingerprint(second.tokenizer) == tokenizer_fingerprint(first.tokenizer)
    ids = first.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)


def _scribble_after_the_header(path, size: int = 4 << 20) -> None:
    """Random bytes over ``size`` bytes (or all) of a safetensors file's tensors, its header intact."""
    with path.open("r+b") as file:
        start = 8 + int.from_bytes(file.read(8), "little")
        file.seek(start)
        file.write(os.urandom(min(size, path.stat().st_size - start)))


@needs_block_kernel
@pytest.mark.parametrize("damage", ["garbage in dense.safetensors", "killed before its manifest"])
def test_a_damaged_layout_is_named_never_loaded_and_written_anew(tmp_path, monkeypatch, capsys, damage):
    """Issue 83's second row: garbage inside a layout's dense tensors (the file still parses, so only
    the digest tells) once loaded and generated an empty string; a write killed before its manifest
    is as untrusted. The entry load_target writes again then computes the model's logits."""
    from safetensors.torch import load_file

    monkeypatch.setattr(gguf_cache, "cache_root", lambda: tmp_path / "cache")
    model, gguf, placements = _placed(tmp_path)
    entry = entry_dir(gguf, torch.bfloat16, "int8")
    save_entry(entry, model, tiny_tokenizer(), placements, "int8")
    clean = load_file(entry / "dense.safetensors")
    if damage == "killed before its manifest":
        (entry / "manifest.json").unlink()
        found = "no manifest: its write did not finish, or an older diffdraft wrote it"
    else:
        _scribble_after_the_header(entry / "dense.safetensors")
        scribbled = load_file(entry / "dense.safetensors")  # what a load without the check would take
        assert scribbled.keys() == clean.keys()
        assert any(not torch.equal(scribbled[name], clean[name]) for name in clean)
        found = "dense.safetensors digest mismatch"
    capsys.readouterr()
    assert load_entry(entry, gguf, torch.bfloat16) is None
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"diffdraft: cannot read the cached layout at {entry} ({found}); loading {gguf.name} anew."
    save_entry(entry, model, tiny_tokenizer(), placements, "int8")  # as load_target does after loading anew
    loaded, _, _ = load_entry(entry, gguf, torch.bfloat16)
    ids = torch.tensor([[5, 17, 3, 250, 9]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # the broken copy is gone
