"""SGLang export: the config fields and weight names SGLang's DFlash support reads, the refused draft
vocabulary, the mask token text, the launch command."""

from __future__ import annotations

import shlex

import pytest
import torch

from diffdraft.errors import ExportError
from diffdraft.export.sglang import build, launch
from diffdraft.target.loading import load_target

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


def test_config_and_weights_hold_what_sglang_reads():
    """parse_dflash_draft_config (python/sglang/srt/speculative/dflash_utils.py) reads block_size,
    num_target_layers, target_layer_ids (each in [0, target layers)) and mask_token_id; the entry
    class DFlashDraftModel (python/sglang/srt/models/dflash.py) checks fc.weight against the number
    of ids, needs silu, treats full_attention layers as non-causal and loads layers.*, fc,
    hidden_norm and norm, with no embedding or LM head."""
    target = tiny_target("qwen3", layers=6, dtype=torch.float32)
    model = tiny_drafter(target, layers=2, block_size=8, target_layer_ids=[1, 2, 4])
    export = build(model, None)
    config = export.config
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    ids = config["dflash_config"]["target_layer_ids"]
    assert ids == [1, 2, 4] and all(0 <= i < config["num_target_layers"] for i in ids)
    mask_token_id = config["dflash_config"]["mask_token_id"]
    assert isinstance(mask_token_id, int) and 0 <= mask_token_id < config["vocab_size"]
    assert "mask_token" not in config["dflash_config"]  # unknown without --target: SGLang's default
    assert config["hidden_act"] == "silu"
    assert all(t == "full_attention" for t in config["layer_types"])
    hidden = config["hidden_size"]
    assert export.weights["fc.weight"].shape == (hidden, hidden * len(ids))
    assert {"hidden_norm.weight", "norm.weight"} <= set(export.weights)
    assert not any("embed_tokens" in name or "lm_head" in name for name in export.weights)


def test_a_draft_vocabulary_is_refused():
    """SGLang drafts with the greedy argmax over the target's full LM head (DFlashWorker in
    python/sglang/srt/speculative/dflash_worker.py): a draft vocabulary cannot be expressed."""
    target = tiny_target("llama", dtype=torch.float32)
    model = tiny_drafter(target, target_layer_ids=[0], draft_vocab=[1, 2, 3])
    with pytest.raises(ExportError, match=r"draft vocabulary of 3 tokens.*--format vllm"):
        build(model, None)


def test_with_the_target_the_mask_token_text_matches_its_id(tmp_path):
    """DFlashWorker._resolve_mask_token_id fails when the tokenizer maps dflash_config.mask_token
    (default "<|MASK|>") to another id than mask_token_id; naming our token makes the two agree."""
    loaded = load_target(make_checkpoint(tmp_path, "llama"), "float32", "cpu")
    model = tiny_drafter(loaded.model, target_layer_ids=[0])
    model.mask_token_id = 7
    text = build(model, loaded).config["dflash_config"]["mask_token"]
    assert loaded.tokenizer.get_vocab()[text] == 7
    model.mask_token_id = len(loaded.tokenizer) + 5  # an id only the model's embedding has
    assert "mask_token" not in build(model, loaded).config["dflash_config"]


def test_launch_command_drafts_one_block(tmp_path):
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16}
    command = shlex.split(launch(tmp_path / "drafter", config, "Qwen/Qwen3-8B"))
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    assert command[command.index("--model-path") + 1] == "Qwen/Qwen3-8B"
    assert command[command.index("--speculative-algorithm") + 1] == "DFLASH"
    assert command[command.index("--speculative-draft-model-path") + 1] == str(tmp_path / "drafter")
    assert command[command.index("--speculative-num-draft-tokens") + 1] == "16"
