"""DEER drafter: exact greedy output under every tree rule, cached drafting equal to a fresh forward,
a depth-1 row that starts as the truncated base LM, the base LM's checkpoint layout, and loud
failures for a drafter of another vocabulary or tokenizer."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import DEERDraftModel, deer_from_causal_lm
from diffdraft.drafters.families import make_drafter
from diffdraft.errors import CheckpointError, IncompatibleDrafterError
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import tiny_tokenizer
from diffdraft_testing.engine import run_engine
from diffdraft_testing.ngram import TrigramTable
from diffdraft_testing.targets import hf_greedy, tiny_target

DEER_CONFIG_KEYS = {
    "block_size",
    "mask_token_id",
    "denoising_steps",
    "base_architectures",
    "tokenizer_fingerprint",
    "initialized_from",
}


def tiny_deer(
    base: torch.nn.Module,
    layers: int = 2,
    block_size: int = 4,
    mask_token_id: int = 1,
    fingerprint=None,
    denoising_steps: int = 1,
) -> DEERDraftModel:
    """A DEER drafter cut from ``base`` (untrained: its mask rows are the base LM's guesses)."""
    return deer_from_causal_lm(
        base, layers, block_size, mask_token_id, fingerprint, "tiny test LM", denoising_steps
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    seed=st.integers(0, 10_000),
    base=st.sampled_from(["target", "other"]),
    rule=st.sampled_from(["chain", "ddtree", "dart", "dart-ngram"]),
    block_size=st.integers(1, 6),
    steps=st.integers(1, 3),
    layers=st.integers(1, 4),
    budget=st.integers(1, 24),
    prompt_len=st.integers(1, 20),
    max_new_tokens=st.integers(1, 30),
)
def test_greedy_deer_is_identical_to_transformers_generate(
    family, seed, base, rule, block_size, steps, layers, budget, prompt_len, max_new_tokens
):
    target = tiny_target(family, seed=seed, vocab=64)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab - 1, (prompt_len,), generator=g).tolist()
    eos = vocab - 1
    reference = hf_greedy(target, prompt, max_new_tokens, eos)
    # "target": the target's own first layers (drafts often right); "other": another random LM of
    # another family with the same vocabulary (drafts often wrong): DEER reads token ids only
    other = ["llama", "qwen3"][seed % 2]
    source = target if base == "target" else tiny_target(other, seed=seed + 1, vocab=vocab)
    mask_token_id = int(torch.randint(vocab, (), generator=g))
    model = tiny_deer(source, layers, block_size, mask_token_id, denoising_steps=steps)
    drafter = DEERDrafter(model, TargetModel(target))
    dart_settings = DartTreeSettings(tree_size=budget, top_k=4, beam_width=3)
    builder = {
        "chain": ChainBuilder(),
        "ddtree": DDTreeBuilder(budget),
        "dart": DartTreeBuilder(dart_settings),
        "dart-ngram": DartTreeBuilder(dart_settings, TrigramTable(vocab, seed)),
    }[rule]
    ours, stats = run_engine(target, drafter, builder, prompt, max_new_tokens, eos)
    assert ours == reference
    assert stats.stop_reason == ("eos" if reference[-1] == eos else "max_new_tokens")


def fresh_log_probs(model: DEERDraftModel, token_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """What a drafter with no cache computes: the committed tokens causal, the last one's row
    predicting depth 1, then ``depth - 1`` mask rows that see the prefix and one another."""
    committed = token_ids.shape[0]
    rows = torch.cat([token_ids, torch.full((depth - 1,), model.mask_token_id)])
    visible = torch.ones(rows.shape[0], rows.shape[0], dtype=torch.bool).tril()
    visible[committed:, committed:] = True
    hidden = model(rows[None], torch.arange(rows.shape[0])[None], visible[None, None])
    return model.lm_head(hidden[0, committed - 1 :]).log_softmax(-1)


def test_cached_drafting_equals_a_fresh_forward_every_round():
    torch_target = tiny_target("qwen3", seed=4, vocab=12)  # small: wide trees accept several tokens
    target = TargetModel(torch_target)
    model = tiny_deer(torch_target, layers=4, block_size=5, mask_token_id=10)  # depth 1 = the target
    checked = []

    class Checked(DEERDrafter):
        def propose(self, token_ids, depth):
            proposal = super().propose(token_ids, depth)
            with torch.inference_mode():
                expected = fresh_log_probs(self.model, token_ids, depth)
            torch.testing.assert_close(proposal.log_probs, expected.float(), atol=1e-5, rtol=1e-5)
            checked.append(depth)
            return proposal

    prompt = [5, 9, 3, 7, 5, 9, 3]
    reference = hf_greedy(torch_target, prompt, 24, None)
    ours, stats = run_engine(torch_target, Checked(model, target), DDTreeBuilder(16), prompt, 24, -1)
    assert ours == reference
    assert len(checked) >= stats.rounds - 1 >= 4  # a last round with one token left drafts nothing
    assert max(stats.acceptance_lengths) >= 3  # rounds that commit several tokens at once
    assert min(checked) < 5  # rounds near the end draft fewer positions than the drafter could


def test_each_denoising_step_shows_the_tokens_filled_so_far_and_leaves_the_cache_as_it_was():
    base = tiny_target("llama", seed=6, vocab=24, layers=3)
    target = TargetModel(base)
    one_step = DEERDrafter(tiny_deer(base, 2, 5, 22), target)
    two_steps = DEERDrafter(tiny_deer(base, 2, 5, 22, denoising_steps=2), target)
    ids = torch.tensor([3, 9, 4, 17, 6, 2])
    first = one_step.propose(ids, 5).log_probs
    refined = two_steps.propose(ids, 5).log_probs
    assert two_steps._cache.get_seq_length() == ids.shape[0]  # only committed tokens stay cached
    # step 1 fills the 3 most confident depths; step 2 re-drafts the others with those tokens shown
    filled = torch.zeros(5, dtype=torch.bool)
    filled[first.max(-1).values.topk(3).indices] = True
    torch.testing.assert_close(refined[filled], first[filled])
    rows = torch.where(filled[:-1], first[:-1].argmax(-1), torch.full((4,), 22))
    visible = torch.ones(10, 10, dtype=torch.bool).tril()
    visible[6:, 6:] = True
    model = two_steps.model
    with torch.no_grad():
        hidden = model(torch.cat([ids, rows])[None], torch.arange(10)[None], visible[None, None])
        expected = model.lm_head(hidden[0, 6:]).float().log_softmax(-1)
    torch.testing.assert_close(refined[1:][~filled[1:]], expected[~filled[1:]], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(refined, first)  # the second step changed something


def test_a_block_as_long_as_the_context_is_refused():
    base = tiny_target("llama", vocab=24, max_positions=8)
    with pytest.raises(IncompatibleDrafterError, match="smaller --block-size"):
        DEERDrafter(tiny_deer(base, 1, 8, 22), TargetModel(base))


def truncated(base: torch.nn.Module, layers: int) -> torch.nn.Module:
    """``base``'s first ``layers`` layers, its final norm and its head, as a causal LM of its own."""
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(base.dtype).eval()
    model.load_state_dict(base.state_dict(), strict=False)  # the dropped layers' weights are left out
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_depth_1_row_starts_as_the_truncated_base_lm(family):
    base = tiny_target(family, seed=3, vocab=40, layers=4)
    expected = truncated(base, 2)(torch.tensor([[4, 8, 15, 16, 23]])).logits[0, -1].log_softmax(-1)
    model = tiny_deer(base, layers=2, block_size=4, mask_token_id=39).double()
    for depth in (1, 4):  # the mask rows after it change nothing: the prefix is causal
        ids = torch.tensor([4, 8, 15, 16, 23])
        with torch.no_grad():
            torch.testing.assert_close(fresh_log_probs(model, ids, depth)[0], expected)
        drafter = DEERDrafter(model, TargetModel(base))
        proposal = drafter.propose(ids, depth)
        assert proposal.log_probs.shape == (depth, 40)
        torch.testing.assert_close(proposal.log_probs[0], expected.float(), atol=1e-5, rtol=1e-5)


def tied_llama(vocab: int = 64) -> torch.nn.Module:
    """A tiny random Llama whose head is its embedding (``tiny_target`` unties them by default)."""
    return tiny_target("llama", vocab=vocab, layers=3, tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [False, True])
def test_deer_checkpoint_has_the_base_lm_layout_and_round_trips(tmp_path, tied):
    base = tied_llama() if tied else tiny_target("llama", layers=3)
    fingerprint = tokenizer_fingerprint(tiny_tokenizer())
    model = tiny_deer(base, layers=2, block_size=6, mask_token_id=7, fingerprint=fingerprint)
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DEERDraftModel"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2
    assert set(config["deer_config"]) == DEER_CONFIG_KEYS
    assert config["deer_config"]["block_size"] == 6 and config["deer_config"]["mask_token_id"] == 7
    assert config["deer_config"]["tokenizer_fingerprint"] == fingerprint
    assert config["deer_config"]["base_architectures"] == list(base.config.architectures or [])
    weights = load_file(tmp_path / "model.safetensors")
    kept = {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"}
    assert kept <= set(weights) and not any(name.startswith("model.layers.2.") for name in weights)
    assert ("lm_head.weight" in weights) == (not tied)  # a tied head is stored once, as Hugging Face does
    loaded = load_draft_model(tmp_path)
    assert isinstance(loaded, DEERDraftModel) and loaded.tied == tied
    assert (loaded.block_size, loaded.mask_token_id, loaded.tokenizer_fingerprint) == (6, 7, fingerprint)
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.float())
    ids = torch.tensor([3, 1, 4, 1, 5])
    original = DEERDrafter(model, TargetModel(base)).propose(ids, 6).log_probs
    again = DEERDrafter(loaded, TargetModel(base)).propose(ids, 6).log_probs
    torch.testing.assert_close(again, original, atol=1e-5, rtol=1e-5)


def test_broken_deer_checkpoints_fail_loudly(tmp_path):
    save_draft_model(tiny_deer(tiny_target("qwen3")), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'deer'.*missing \['model.layers.1.self_attn.k_norm.weight'\]"
    ):
        load_draft_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_draft_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing its weights file"):
        load_draft_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["deer_config"]["mask_token_id"] = 64  # outside the vocabulary
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unusable config.*mask_token_id 64"):
        load_draft_model(tmp_path)


def test_a_deer_drafter_of_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    target = tiny_target("qwen3", vocab=320)
    tokenizer = tiny_tokenizer()
    other_vocab = tiny_deer(tiny_target("llama", vocab=80))
    with pytest.raises(IncompatibleDrafterError, match="vocab size 80 != target vocab size 320"):
        DEERDrafter(other_vocab, TargetModel(target))
    save_draft_model(other_vocab, tmp_path / "other-vocab")
    with pytest.raises(IncompatibleDrafterError, match="vocab size 80"):
        make_drafter(load_draft_model(tmp_path / "other-vocab"), TargetModel(target), tokenizer)

    changed = copy.deepcopy(tokenizer)
    changed.add_tokens(["<extra>"])  # same model vocabulary size, other token ids
    other_tokenizer = tiny_deer(target, fingerprint=tokenizer_fingerprint(changed))
    with pytest.raises(IncompatibleDrafterError, match=r"built with tokenizer sha256:.*build a drafter from"):
        make_drafter(other_tokenizer, TargetModel(target), tokenizer)
    assert isinstance(make_drafter(other_tokenizer, TargetModel(target)), DEERDrafter)  # no tokenizer known
    same = tiny_deer(target, fingerprint=tokenizer_fingerprint(tokenizer))
    assert isinstance(make_drafter(same, TargetModel(target), tokenizer), DEERDrafter)
    unrecorded = tiny_deer(target, fingerprint=None)  # nothing recorded: nothing to check
    assert isinstance(make_drafter(unrecorded, TargetModel(target), changed), DEERDrafter)
