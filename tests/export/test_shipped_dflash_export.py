"""The shipped DFlash drafter (``default-dflash``) exported for vLLM, SGLang and llama.cpp, and drafting
in llama.cpp's own DFlash where its binaries are built."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.errors import ExportError
from diffdraft.export import export_drafter

from diffdraft_testing.llama_cpp import llama_cpp_binary

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def shipped():
    return load_draft_model("default-dflash")


def test_vllm_gets_the_network_its_draft_vocabulary_and_the_default_target_s_head_rows(shipped, tmp_path):
    export_drafter("default-dflash", "vllm", tmp_path / "vllm", target="default")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == shipped.block_size
    assert config["dflash_config"]["target_layer_ids"] == shipped.target_layer_ids
    assert config["draft_vocab_size"] == shipped.draft_vocab.shape[0]
    written = load_file(tmp_path / "vllm" / "model.safetensors")
    vocab = shipped.draft_vocab.shape[0]
    assert (torch.arange(vocab) + written["d2t"]).tolist() == shipped.draft_vocab.tolist()
    for name, tensor in shipped.state_dict().items():
        if name != "draft_vocab":
            torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)


def test_sglang_takes_it_over_the_whole_vocabulary_only_when_asked(shipped, tmp_path):
    with pytest.raises(ExportError, match="--full-vocabulary"):
        export_drafter("default-dflash", "sglang", tmp_path / "refused", target="default")
    assert not (tmp_path / "refused").exists()
    export_drafter("default-dflash", "sglang", tmp_path / "sglang", target="default", full_vocabulary=True)
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert "draft_vocab_size" not in config and "draft_vocab_size" not in config["dflash_config"]
    assert config["dflash_config"]["mask_token_id"] == shipped.mask_token_id
    written = load_file(tmp_path / "sglang" / "model.safetensors")
    assert "d2t" not in written and "lm_head.weight" not in written
    assert set(written) == set(shipped.state_dict()) - {"draft_vocab"}
    assert load_draft_model(tmp_path / "sglang").draft_vocab is None


def test_llama_cpp_gets_one_gguf_with_the_taps_plus_one_and_d2t(shipped, tmp_path):
    out = tmp_path / "drafter.gguf"
    export_drafter("default-dflash", "llama.cpp", out, target="default")
    reader = GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == shipped.block_size
    assert fields["dflash.target_layers"] == [i + 1 for i in shipped.target_layer_ids]
    assert fields["tokenizer.ggml.mask_token_id"] == shipped.mask_token_id
    tensors = {t.name: t for t in reader.tensors}
    assert np.array(tensors["d2t"].data).tolist() == shipped.draft_vocab.tolist()


def test_llama_cpp_accepts_the_shipped_drafter_s_drafts(tmp_path):
    """A wrong tap, layer or head mapping leaves a trained drafter near zero acceptance; llama.cpp's
    DFlash must accept a good share of what this one drafts on a chat prompt."""
    speculative = llama_cpp_binary("llama-speculative-simple")
    from diffdraft.target.default_model import default_gguf_path

    export_drafter("default-dflash", "llama.cpp", tmp_path / "d.gguf", target="default")
    question = "Write a Python function that returns the sum of a list."
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    run = subprocess.run(
        [str(speculative), "-m", str(default_gguf_path()), "-md", str(tmp_path / "d.gguf"),
         "--spec-type", "draft-dflash", "--spec-draft-n-max", "7", "-p", prompt, "-n", "64", "-t", "2",
         "--temp", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    accept = re.search(r"accept\s+=\s+([\d.]+)%", run.stdout + run.stderr)
    assert accept is not None and float(accept.group(1)) > 2.5, (run.stdout + run.stderr)[-1500:]
