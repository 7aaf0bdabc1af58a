"""The lean verification forward gives Hugging Face's logits, taps and cache, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.grouped_attention import use_grouped_attention
from diffdraft.kernels.lean_forward import LeanForward
from diffdraft.kernels.packed_linear import pack_linear_layers
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree

from conftest import needs_packing, tiny_target

PROMPT = [3, 9, 4, 1, 7, 7, 2, 5, 8]
TREE = DraftTree(
    tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
    parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
)


def _hugging_face_verify(target: TargetModel, cache, tree: DraftTree | None, layer_ids: list[int]):
    """The verification forward through the model's own ``forward``."""
    tokens = tree.tokens if tree is not None else torch.tensor([5])
    start = cache.get_seq_length()
    mask = target.attention_mask(cache, tree.ancestor_mask()) if tree is not None else None
    with torch.inference_mode():
        return target._forward(cache, tokens, torch.arange(start, start + len(tokens)), mask, layer_ids, 0)


def _assert_same_as_hugging_face(model: torch.nn.Module, layer_ids: list[int]) -> None:
    target = TargetModel(model)
    assert target.lean is not None
    for tree in (TREE, None):  # a tree under a mask, and one token over the whole cache
        ours, theirs = target.new_cache(), target.new_cache()
        for cache in (ours, theirs):
            target.prefill(cache, torch.tensor(PROMPT), [])
        start = len(PROMPT)
        tokens = tree.tokens if tree is not None else torch.tensor([5])
        mask = target.attention_mask(ours, tree.ancestor_mask()) if tree is not None else None
        out = target.verify(ours, tokens, torch.arange(start, start + len(tokens)), mask, layer_ids)
        expected = _hugging_face_verify(target, theirs, tree, layer_ids)
        assert torch.equal(out.logits, expected.logits)
        assert torch.equal(out.hidden, expected.hidden) if layer_ids else out.hidden is None
        for mine, reference in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_taps_and_cache_equal_hugging_face(family, dtype):
    # the last layer's tap is reported after the final norm, as Hugging Face does
    _assert_same_as_hugging_face(tiny_target(family, seed=3, dtype=dtype), layer_ids=[0, 2, 3])
    _assert_same_as_hugging_face(tiny_target(family, seed=4, dtype=dtype), layer_ids=[])
    # the forward stacks its taps in ascending order: other orders and repeats are picked from them
    _assert_same_as_hugging_face(tiny_target(family, seed=6, dtype=dtype), layer_ids=[3, 0, 2, 0])


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
    _assert_same_as_hugging_face(model, layer_ids=[1, 3])


def test_families_it_does_not_know_and_sliding_windows_keep_hugging_face_forward():
    assert LeanForward.supports(tiny_target("qwen2"))
    sliding = tiny_target("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not LeanForward.supports(sliding)
    assert TargetModel(sliding).lean is None
    assert not LeanForward.supports(torch.nn.Linear(2, 2))


def test_a_prefill_without_a_mask_is_refused():
    target = TargetModel(tiny_target())
    cache = target.new_cache()
    with pytest.raises(ValueError, match="one token"):
        target.lean(cache, torch.tensor(PROMPT), torch.arange(len(PROMPT)), None, [])
