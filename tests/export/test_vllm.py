"""vLLM export: the config fields and weight names vLLM's DFlash support reads, the draft vocabulary
(``d2t`` + head rows), the launch command."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from diffdraft.errors import ExportError
from diffdraft.export.vllm import build, launch
from diffdraft.target.loading import load_target

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import DFLASH_LAYER_WEIGHTS, tiny_drafter
from diffdraft_testing.targets import tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A saved 2-layer target with a tokenizer (for --target)."""
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama")


def test_config_and_weights_hold_what_vllm_reads():
    """vllm/config/speculative.py wraps the config in EAGLEConfig (vllm/transformers_utils/configs/
    eagle.py), which keeps an architecture starting with "DFlash"; the registry maps
    DFlashDraftModel to DFlashQwen3ForCausalLM (vllm/model_executor/models/qwen3_dflash.py), whose
    DFlashQwen3Model.__init__ reads dflash_config.mask_token_id and sizes fc from the aux layers of
    get_eagle3_aux_layers_from_config (.../spec_decode/eagle/eagle3_utils.py): target_layer_ids + 1
    unless eagle_aux_hidden_state_layer_ids is set. DFlashQwen3ForCausalLM.load_weights takes the
    official names, shares the target's embedding and head when the checkpoint has none, and
    maps d2t only when present."""
    target = tiny_target("qwen3", layers=6, dtype=torch.float32)
    model = tiny_drafter(target, layers=2, block_size=8, target_layer_ids=[1, 2, 4])
    export = build(model, None)
    config = export.config
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": model.mask_token_id, "target_layer_ids": [1, 2, 4]}
    assert "eagle_aux_hidden_state_layer_ids" not in config  # it would override the ids above
    assert "target_layer_ids" not in config  # EAGLEConfig refuses a top-level copy that disagrees
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert "draft_vocab_size" not in config  # vLLM defaults it to vocab_size: no d2t, full head
    assert not config.get("is_causal") and "causal" not in config["dflash_config"]
    assert all(t == "full_attention" for t in config["layer_types"])  # _dflash_layer_causal -> False
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert config[field] == getattr(model.config, field)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in DFLASH_LAYER_WEIGHTS}
    assert set(export.weights) == expected
    hidden = config["hidden_size"]
    aux_layers = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    assert export.weights["fc.weight"].shape == (hidden, hidden * len(aux_layers))


def test_a_draft_vocabulary_exports_d2t_and_the_targets_head_rows(target_dir):
    """vLLM's DFlashQwen3ForCausalLM.compute_logits puts draft row i at target id i + d2t[i]; its
    lm_head has draft_vocab_size rows and is loaded from the checkpoint (has_own_lm_head)."""
    loaded = load_target(target_dir, "float32", "cpu")
    vocab = [5, 9, 10, 40, 200, 318]
    model = tiny_drafter(loaded.model, target_layer_ids=[0], draft_vocab=vocab)
    export = build(model, loaded)
    assert export.config["draft_vocab_size"] == len(vocab)
    d2t = export.weights["d2t"]
    assert d2t.dtype == torch.int64
    assert (torch.arange(len(vocab)) + d2t).tolist() == vocab
    head = loaded.model.get_output_embeddings().weight
    torch.testing.assert_close(export.weights["lm_head.weight"], head[vocab], rtol=0, atol=0)
    # vLLM's scatter of the draft logits gives the same full-vocabulary logits as our DFlashDrafter
    draft_logits = torch.randn(3, len(vocab))
    ours = torch.full((3, head.shape[0]), float("-inf")).index_copy_(1, torch.tensor(vocab), draft_logits)
    theirs = torch.full((3, head.shape[0]), float("-inf"))
    theirs[:, torch.arange(len(vocab)) + d2t] = draft_logits
    torch.testing.assert_close(theirs, ours)


def test_a_draft_vocabulary_without_the_target_is_refused():
    target = tiny_target("llama", dtype=torch.float32)
    model = tiny_drafter(target, target_layer_ids=[0], draft_vocab=[1, 2, 3])
    with pytest.raises(ExportError, match=r"draft vocabulary of 3 tokens.*--target"):
        build(model, None)


def test_launch_command_drafts_block_size_minus_one_tokens(tmp_path):
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16}
    command = shlex.split(launch(tmp_path / "drafter dir", config, "Qwen/Qwen3-8B"))
    assert command[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "drafter dir"), "num_speculative_tokens": 15}
