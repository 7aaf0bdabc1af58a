"""Grouped-query SDPA under a mask: the same numbers as Hugging Face's SDPA path, without its copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from diffdraft.grouped_attention import NAME, grouped_sdpa_attention, use_grouped_attention
from diffdraft.target import TargetModel

from conftest import tiny_target


class _Attention(nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("queries", "cached", "masked"), [(1, 40, False), (9, 40, True), (6, 0, False)])
def test_the_output_is_hugging_faces_sdpa_output_bit_for_bit(dtype, queries, cached, masked):
    generator = torch.Generator().manual_seed(queries + cached)
    query = torch.randn(1, 6, queries, 16, generator=generator).to(dtype)
    key = torch.randn(1, 2, cached + queries, 16, generator=generator).to(dtype)
    value = torch.randn(1, 2, cached + queries, 16, generator=generator).to(dtype)
    mask = None
    if masked:  # a random tree's visibility over the cache plus itself
        visible = torch.rand(queries, cached + queries, generator=generator) < 0.7
        visible[:, :cached] = True
        visible[range(queries), range(cached, cached + queries)] = True
        mask = torch.zeros(1, 1, queries, cached + queries, dtype=dtype)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
    module = _Attention(groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_switched_target_verifies_trees_with_the_stock_logits(dtype):
    stock = tiny_target(dtype=dtype, vocab=96, hidden=64)
    grouped = copy.deepcopy(stock)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == NAME
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0))
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    logits = []
    for model in (stock, grouped):
        target = TargetModel(model)
        cache = target.new_cache()
        prefill = target.prefill(cache, ids[:26], []).logits
        mask = target.attention_mask(cache, tree_mask)
        tree = target.verify(cache, ids[26:], torch.tensor([26, 27, 27, 28]), mask, []).logits
        logits.append((prefill, tree))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])


def test_models_off_cpu_or_off_sdpa_are_left_alone():
    eager = tiny_target()
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager)
    assert eager.config._attn_implementation == "eager"
