"""Grouped-query SDPA under a mask: Hugging Face's SDPA numbers without its copies (bit for bit in
float32, within rounding where query groups attend as rows)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from diffdraft.kernels.grouped_attention import NAME, grouped_sdpa_attention, use_grouped_attention
from diffdraft.target.model import TargetModel

from diffdraft_testing.targets import tiny_target


class _Attention(nn.Module):
    is_causal = True

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(dtype, queries, cached, masked, heads=6, kv_heads=2):
    generator = torch.Generator().manual_seed(queries + cached)
    query = torch.randn(1, heads, queries, 16, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, cached + queries, 16, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, cached + queries, 16, generator=generator).to(dtype)
    mask = None
    if masked:  # a random tree's visibility over the cache plus itself
        visible = torch.rand(queries, cached + queries, generator=generator) < 0.7
        visible[:, :cached] = True
        visible[range(queries), range(cached, cached + queries)] = True
        mask = torch.zeros(1, 1, queries, cached + queries, dtype=dtype)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return query, key, value, mask


@pytest.mark.parametrize(("queries", "cached", "masked"), [(1, 40, False), (9, 40, True), (6, 0, False)])
def test_float32_output_is_hugging_faces_sdpa_output_bit_for_bit(queries, cached, masked):
    query, key, value, mask = _inputs(torch.float32, queries, cached, masked)
    module = _Attention(groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("queries", "cached", "masked"), [(1, 40, False), (9, 40, True), (6, 0, False)])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_reduced_precision_rows_are_exact_attention_up_to_rounding(
    dtype, queries, cached, masked, per_head_mask
):
    """Query groups as rows: each head must still attend to its own K/V head under its own mask row,
    so the result is the float64 attention within the dtype's rounding (a mix-up is off by ~1)."""
    query, key, value, mask = _inputs(dtype, queries, cached, masked)
    if mask is not None and per_head_mask:  # a different visibility per head
        mask = mask.expand(1, 6, -1, -1).clone()
        mask[:, 1::2, :, cached] = torch.finfo(dtype).min
    module = _Attention(groups=3)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    exact = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(3, dim=1),
        value.double().repeat_interleave(3, dim=1),
        attn_mask=mask.double() if mask is not None else None,
        scale=0.25,
        is_causal=mask is None and queries > 1,
    ).transpose(1, 2)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    stock_error = (stock.double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= max(2 * stock_error, 4 * torch.finfo(dtype).eps)


def test_a_mask_broadcast_over_queries_takes_the_stock_kernel_call():
    query, key, value, _ = _inputs(torch.bfloat16, 4, 20, masked=False)
    mask = torch.zeros(1, 1, 1, 24, dtype=torch.bfloat16)
    mask[..., :5] = torch.finfo(torch.bfloat16).min
    module = _Attention(groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    got, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_switched_target_verifies_trees_with_the_stock_logits(dtype):
    """Bit for bit in float32; bfloat16 rounds differently (query groups as rows), so within rounding."""
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
    assert torch.equal(logits[0][0], logits[1][0])  # a prefill is causal: the stock kernel call
    if dtype == torch.float32:
        assert torch.equal(logits[0][1], logits[1][1])
    else:  # bfloat16 attends with query groups as rows: the same logits up to rounding
        torch.testing.assert_close(logits[1][1], logits[0][1], atol=0.05, rtol=0.02)


def test_models_off_cpu_or_off_sdpa_are_left_alone():
    eager = tiny_target()
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager)
    assert eager.config._attn_implementation == "eager"
