"""Stacked sibling projections change the call count, never a number, and hold no activations."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diffdraft.kernels.fused_projections import ProjectionSlice, StackedProjection, fuse_projections
from diffdraft.kernels.packed_linear import PackedLinear, pack_linear_layers

from diffdraft_testing.markers import needs_packing
from diffdraft_testing.targets import tiny_target


def _packed(rows: int, inputs: int, bias: bool, seed: int) -> PackedLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(inputs, rows, bias=bias).to(torch.bfloat16)
    return PackedLinear(linear.weight, linear.bias)


@needs_packing
@pytest.mark.parametrize(("widths", "inputs", "bias"), [((576, 192, 192), 576, False), ((20, 40), 40, True)])
@pytest.mark.parametrize("rows", [1, 2, 9, 33, 300])
def test_every_slice_equals_its_own_packed_projection(widths, inputs, bias, rows):
    siblings = [_packed(width, inputs, bias, seed) for seed, width in enumerate(widths)]
    stacked = StackedProjection(siblings)
    slices = [ProjectionSlice(stacked, i) for i in range(len(widths))]
    x = torch.randn(1, rows, inputs, dtype=torch.bfloat16)
    for sibling, piece in zip(siblings, slices, strict=True):
        assert torch.equal(piece(x), sibling(x))
        assert torch.equal(piece.weight, sibling.weight)
    assert stacked._output is None  # every sibling read it: nothing is held


@needs_packing
def test_a_sibling_called_on_another_input_gets_its_own_projection():
    siblings = [_packed(16, 8, False, 0), _packed(24, 8, False, 1)]
    stacked = StackedProjection(siblings)
    first, second = ProjectionSlice(stacked, 0), ProjectionSlice(stacked, 1)
    x, y = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(first(x), siblings[0](x))
    assert torch.equal(second(y), siblings[1](y))  # not x's cached columns
    assert torch.equal(first(x), siblings[0](x))


@needs_packing
@pytest.mark.parametrize(("family", "hidden"), [("llama", 64), ("qwen2", 40), ("qwen3", 32)])
def test_a_fused_target_keeps_its_logits_and_its_state_dict(family, hidden):
    stock = tiny_target(family, dtype=torch.bfloat16, vocab=96, hidden=hidden, init_std=0.05)
    fused = copy.deepcopy(stock)
    pack_linear_layers(fused)
    assert fuse_projections(fused) == 2 * 4  # attention and MLP of every layer
    assert isinstance(fused.model.layers[0].self_attn.k_proj, ProjectionSlice)
    for length in (1, 9, 70):
        ids = torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            assert torch.equal(fused(ids).logits, stock(ids).logits)
    expected, got = stock.state_dict(), fused.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_unpacked_projections_are_left_alone():
    model = tiny_target(dtype=torch.float32)
    assert fuse_projections(model) == 0
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
