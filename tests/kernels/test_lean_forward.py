"""The lean verification forward gives Hugging Face's logits, taps and cache, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from diffdraft.kernels.attention_window import SLIDING
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.grouped_attention import use_grouped_attention
from diffdraft.kernels.lean_forward import LeanForward
from diffdraft.kernels.packed_linear import pack_linear_layers
from diffdraft.target.model import TargetModel, VerifyInput

from diffdraft_testing.engine import make_method, run_engine
from diffdraft_testing.hugging_face import (
    PROMPT,
    TREE,
    assert_same_as_hugging_face,
    assert_windowed_same_as_hugging_face,
)
from diffdraft_testing.markers import needs_packing
from diffdraft_testing.targets import WINDOWED_FAMILIES, tiny_target, windowed_target


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_taps_and_cache_equal_hugging_face(family, dtype):
    # the last layer's tap is reported after the final norm, as Hugging Face does
    assert_same_as_hugging_face(tiny_target(family, seed=3, dtype=dtype), layer_ids=[0, 2, 3])
    assert_same_as_hugging_face(tiny_target(family, seed=4, dtype=dtype), layer_ids=[])
    # the forward stacks its taps in ascending order: other orders and repeats are picked from them
    assert_same_as_hugging_face(tiny_target(family, seed=6, dtype=dtype), layer_ids=[3, 0, 2, 0])


@needs_packing
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_equal_on_the_optimized_cpu_kernels_too(family):
    model = copy.deepcopy(tiny_target(family, seed=5, dtype=torch.bfloat16, hidden=64))
    pack_linear_layers(model)
    fuse_projections(model)
    assert use_grouped_attention(model)
    # Llama rotates q and k straight from the stacked projection; Qwen3 norms each head first
    stacked = LeanForward(model).stacked_qkv
    assert all(s is not None for s in stacked) if family == "llama" else all(s is None for s in stacked)
    assert_same_as_hugging_face(model, layer_ids=[1, 3])


def test_families_it_does_not_know_keep_hugging_face_forward():
    assert LeanForward.supports(tiny_target("qwen2"))
    assert not LeanForward.supports(torch.nn.Linear(2, 2))
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))
    assert not LeanForward.supports(gpt2) and TargetModel(gpt2).lean is None
    bidirectional = tiny_target("gemma3", use_bidirectional_attention=True)
    assert not LeanForward.supports(bidirectional)


def test_a_prefill_without_a_mask_is_refused():
    target = TargetModel(tiny_target())
    cache = target.new_cache()
    with pytest.raises(ValueError, match="one token"):
        target.lean(cache, torch.tensor(PROMPT), torch.arange(len(PROMPT)), None, [])


S, F = SLIDING, "full_attention"


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_windowed_families_equal_hugging_face_over_its_sliding_cache(family, dtype):
    model = windowed_target(family, 4, seed=3, dtype=dtype)
    assert_windowed_same_as_hugging_face(model, layer_ids=[0, 2, 3])
    assert_windowed_same_as_hugging_face(model, layer_ids=[])


def test_gemma3_layers_rotate_with_their_own_types_base():
    """Gemma 3's local and global layers rotate with different bases: the lean forward keeps a table
    for each, and hands both to the fused layers' seam."""
    target = TargetModel(windowed_target("gemma3", 4))
    rotaries = target.lean.rotaries
    assert set(rotaries) == {S, F} and rotaries[S] is not rotaries[F]
    like, positions = torch.zeros(1, 1, 32, dtype=torch.float64), torch.arange(3, 9)[None]
    cos = {kind: rotaries[kind](like, positions)[0] for kind in (S, F)}
    assert not torch.equal(cos[S], cos[F])
    assert set(target.lean._rotary(like, positions)) == {S, F}


def test_gemma2_caps_its_logits_and_attention_scores():
    model = windowed_target("gemma2", 4)
    assert model.config.final_logit_softcapping and model.config.attn_logit_softcapping
    assert model.config.query_pre_attn_scalar != model.config.head_dim  # the scaling is not 1/sqrt(d)
    target = TargetModel(model)
    cache = target.new_cache()
    with torch.inference_mode():
        mask = target.attention_mask(cache, torch.ones(9, 9, dtype=torch.bool).tril())
        logits, _ = target.lean(cache, torch.tensor(PROMPT), torch.arange(9), mask, [])
    assert logits.abs().max() <= model.config.final_logit_softcapping


@pytest.mark.parametrize("family", WINDOWED_FAMILIES)
def test_every_method_through_the_lean_forward_matches_plain_decoding(family):
    target = windowed_target(family, 4, seed=5, dtype=torch.float32)
    assert TargetModel(target).lean is not None
    prompt = [3, 9, 4, 1, 7, 7, 2, 5, 8, 3, 9, 4]
    eos = 10_000  # none: every run goes the full length, past the window many times over
    plain, _ = run_engine(target, None, make_method("ar", target, [], prompt, 5, 5)[1], prompt, 24, eos)
    assert len(plain) == 24
    for method in ("pld", "chain", "ddtree-8", "ddtree-8+pld"):
        drafter, builder = make_method(method, target, plain, prompt, block_size=5, seed=5)
        ours, _ = run_engine(target, drafter, builder, prompt, 24, eos)
        assert ours == plain, method


def test_packed_sequences_of_a_hybrid_target_each_take_their_own_masks():
    """Server batching: sequences of different lengths packed into one forward, each under its own
    dict mask (and its own window start), give what each gives alone (up to the rounding of matmuls
    over more rows)."""
    target = TargetModel(windowed_target("gemma3", 4, seed=2))
    prompts = [PROMPT, PROMPT[:3], [*PROMPT, 4, 4, 1]]
    caches = [target.new_cache() for _ in prompts]
    alone = [target.new_cache() for _ in prompts]
    for prompt, cache, other in zip(prompts, caches, alone, strict=True):
        target.prefill(cache, torch.tensor(prompt), [])
        target.prefill(other, torch.tensor(prompt), [])
    trees = [TREE, None, TREE]
    inputs = []
    for cache, tree in zip(caches, trees, strict=True):
        past = cache.get_seq_length()
        tokens = tree.tokens if tree is not None else torch.tensor([5])
        mask = target.attention_mask(cache, tree.ancestor_mask()) if tree is not None else None
        positions = past + (tree.depths if tree is not None else torch.zeros(1, dtype=torch.long))
        inputs.append(VerifyInput(cache, tokens, positions, mask))
    outputs = target.verify_batch(inputs, [0, 3])
    for given, other, out in zip(inputs, alone, outputs, strict=True):
        mask = None if given.mask is None else target.attention_mask(other, TREE.ancestor_mask())
        expected = target.verify(other, given.token_ids, given.position_ids, mask, [0, 3])
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.hidden, expected.hidden)
