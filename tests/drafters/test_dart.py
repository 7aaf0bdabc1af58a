"""DART drafter: exact greedy output under every tree rule, cached drafting equal to a fresh forward,
the released checkpoint layout, and loud failures for a drafter of another target."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.dart_model import eagle3_layer_ids
from diffdraft.errors import CheckpointError, IncompatibleDrafterError
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

from diffdraft_testing.drafters import tiny_dart
from diffdraft_testing.engine import OracleDrafter, run_engine
from diffdraft_testing.ngram import TrigramTable
from diffdraft_testing.targets import hf_greedy, tiny_target

RELEASED_KEYS = {
    "fc.weight",
    "midlayer.mask_rep",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    seed=st.integers(0, 10_000),
    rule=st.sampled_from(["dart", "dart-ngram", "ddtree", "chain", "oracle-dart"]),
    draft_length=st.integers(0, 5),
    tree_size=st.integers(1, 40),
    top_k=st.integers(1, 8),
    beam_width=st.integers(1, 6),
    prompt_len=st.integers(1, 20),
    max_new_tokens=st.integers(1, 30),
)
def test_greedy_dart_is_identical_to_transformers_generate(
    family, seed, rule, draft_length, tree_size, top_k, beam_width, prompt_len, max_new_tokens
):
    target = tiny_target(family, seed=seed, vocab=64)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab - 1, (prompt_len,), generator=g).tolist()
    eos = vocab - 1
    reference = hf_greedy(target, prompt, max_new_tokens, eos)
    half = torch.randperm(vocab, generator=g)[: vocab // 2].tolist() if seed % 3 == 0 else None
    drafter = DARTDrafter(tiny_dart(target, seed, draft_length, draft_vocab=half), TargetModel(target))
    settings_ = DartTreeSettings(tree_size=tree_size, top_k=top_k, beam_width=beam_width)
    builder = {
        "dart": DartTreeBuilder(settings_),
        "dart-ngram": DartTreeBuilder(settings_, TrigramTable(vocab, seed)),
        "ddtree": DDTreeBuilder(tree_size),
        "chain": ChainBuilder(),
        "oracle-dart": DartTreeBuilder(settings_, TrigramTable(vocab, seed)),
    }[rule]
    if rule == "oracle-dart":  # long accepted paths that are not the tree's first branch
        drafter = OracleDrafter(reference, prompt_len, vocab, draft_length + 1, seed)
    ours, stats = run_engine(target, drafter, builder, prompt, max_new_tokens, eos)
    assert ours == reference
    assert stats.stop_reason == ("eos" if reference[-1] == eos else "max_new_tokens")


def fresh_log_probs(model, target: TargetModel, token_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """What a drafter with no cache computes: every prefix row and the masks in one causal forward."""
    root = token_ids.shape[0] - 1
    taps = target.taps(token_ids[:root], model.target_layer_ids)
    embeds = target.model.get_input_embeddings()(token_ids[1 : root + 1])
    inputs, residual = model.prefix_inputs(taps[None], embeds[None])
    mask_in, mask_res = model.mask_inputs(1, depth - 1)
    inputs, residual = torch.cat([inputs, mask_in], 1), torch.cat([residual, mask_res], 1)
    positions = torch.arange(inputs.shape[1])[None]
    causal = torch.ones(inputs.shape[1], inputs.shape[1], dtype=torch.bool).tril()
    hidden = model(inputs, residual, positions, model.key_values(inputs, positions), causal[None, None])
    return model.logits(hidden[0, root - 1 :]).log_softmax(-1)


def test_cached_drafting_equals_a_fresh_forward_every_round():
    torch_target = tiny_target("qwen3", seed=4, vocab=12)  # small: wide trees accept several tokens
    target = TargetModel(torch_target)
    model = tiny_dart(torch_target, seed=4, draft_length=4)
    checked = []

    class Checked(DARTDrafter):
        def propose(self, token_ids, depth):
            proposal = super().propose(token_ids, depth)
            with torch.inference_mode():
                expected = fresh_log_probs(self.model, target, token_ids, depth)
            torch.testing.assert_close(proposal.log_probs, expected.float(), atol=1e-5, rtol=1e-5)
            checked.append(depth)
            return proposal

    prompt = [5, 9, 3, 7, 5, 9, 3]
    reference = hf_greedy(torch_target, prompt, 24, None)
    drafter = Checked(model, target)
    builder = DartTreeBuilder(DartTreeSettings(tree_size=60, top_k=12))
    ours, stats = run_engine(torch_target, drafter, builder, prompt, 24, -1)
    assert ours == reference
    assert len(checked) >= stats.rounds - 1 >= 4  # a last round with one token left drafts nothing
    assert max(stats.acceptance_lengths) >= 2  # rounds that commit several rows at once
    assert min(checked) < 5  # rounds near the end draft fewer positions than the drafter could


def test_dart_checkpoint_has_the_released_layout_and_round_trips(tmp_path):
    target = tiny_target("llama")
    model = tiny_dart(target, draft_length=6, draft_vocab=[3, 9, 10, 40, 41])
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DARTDraftModel"]
    assert config["draft_length"] == 6 and config["draft_vocab_size"] == 5
    assert config["dart_config"]["target_layer_ids"] == [0, 2, 3]
    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == RELEASED_KEYS
    assert weights["fc.weight"].shape == (32, 3 * 32)
    assert weights["midlayer.mask_rep"].shape == (64,)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 64
    assert (torch.arange(5) + weights["d2t"]).tolist() == [3, 9, 10, 40, 41]  # offsets, as released
    assert weights["t2d"].nonzero().flatten().tolist() == [3, 9, 10, 40, 41]
    loaded = load_draft_model(tmp_path)
    assert loaded.max_depth == 7
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_a_released_style_checkpoint_loads_unchanged(tmp_path):
    """No architectures string, no layer ids, the target's embedding inside: as fvliang/DART ships."""
    target = tiny_target("llama", layers=8)
    model = tiny_dart(target)
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("architectures", "dart_config"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().float().clone()
    save_file(weights, tmp_path / "model.safetensors")
    loaded = load_draft_model(tmp_path)
    assert loaded.target_layer_ids == eagle3_layer_ids(8) == [1, 3, 4]
    assert loaded.draft_length == 3


def test_incompatible_or_broken_dart_checkpoints_fail_loudly(tmp_path):
    target = tiny_target("llama")
    other = tiny_target("llama", hidden=48)
    with pytest.raises(IncompatibleDrafterError, match="hidden size 48"):
        DARTDrafter(tiny_dart(other), TargetModel(target))
    with pytest.raises(IncompatibleDrafterError, match="vocab size 80"):
        DARTDrafter(tiny_dart(tiny_target("llama", vocab=80)), TargetModel(target))
    with pytest.raises(IncompatibleDrafterError, match="target with 6 layers, this target has 4"):
        DARTDrafter(tiny_dart(tiny_target("llama", layers=6)), TargetModel(target))
    save_draft_model(tiny_dart(target), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["midlayer.mask_rep"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"variant 'dart'.*missing \['midlayer.mask_rep'\]"):
        load_draft_model(tmp_path)
