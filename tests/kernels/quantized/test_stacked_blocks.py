"""Siblings stacked across formats: one call, each column the bits of its sibling's own call."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from diffdraft.kernels.fused_projections import ProjectionSlice, fuse_projections
from diffdraft.kernels.quantized.block_linear import (
    BlockQuantizedLinear,
    BlockWeight,
    Q8Weight,
    block_kernels,
)
from diffdraft.kernels.quantized.gguf_blocks import GGUFBlocks
from diffdraft.kernels.quantized.stacked_blocks import StackedBlocks
from diffdraft.kernels.quantized.tile_layout import INT8_FORMATS, STACKED

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import random_gguf_bytes


def _weight(format: str, out: int, inputs: int, seed: int):
    if format == "Q4_1":
        return BlockWeight.from_gguf(random_gguf_bytes(format, out, inputs, seed))
    if format == "Q8_0":
        dense = torch.randn(out, inputs, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
        return Q8Weight.from_gguf(quants.quantize(dense, GGMLQuantizationType.Q8_0))
    return GGUFBlocks.from_gguf(random_gguf_bytes(format, out, inputs, seed), format)


@needs_block_kernel
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    formats=st.lists(st.sampled_from(INT8_FORMATS), min_size=2, max_size=3),
    tiles=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    last=st.integers(1, 40),
    rows=st.integers(1, 20),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_each_column_is_its_siblings_own_call(formats, tiles, last, rows, bias, seed):
    widths = [16 * t for t in tiles[: len(formats) - 1]] + [last]
    siblings = [
        BlockQuantizedLinear(_weight(f, w, 512, seed + i), torch.randn(w) if bias else None)
        for i, (f, w) in enumerate(zip(formats, widths, strict=True))
    ]
    assert BlockQuantizedLinear.can_stack(siblings)
    stacked = BlockQuantizedLinear.stacked(siblings)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    expected = torch.cat([sibling(x) for sibling in siblings], dim=-1)
    assert torch.equal(stacked(x), expected)
    assert torch.equal(stacked.weight, torch.cat([sibling.weight for sibling in siblings]))
    number = stacked.int8_operands()[2]
    assert stacked.blocks.format == (STACKED if len(set(formats)) > 1 else formats[0])
    assert number == stacked.int8_operands()[2] and stacked.out_features == sum(widths)


@needs_block_kernel
def test_stacks_stacked_again_keep_each_column_its_siblings_own():
    """Stacks of one name ("stacked") are no one format: their parts are laid out anew, never their
    tiles (each behind its own header) put end to end."""
    layers = [
        BlockQuantizedLinear(_weight(f, 32, 256, i)) for i, f in enumerate(["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
    ]
    first, second = BlockQuantizedLinear.stacked(layers[:2]), BlockQuantizedLinear.stacked(layers[2:])
    assert BlockQuantizedLinear.can_stack([first, second])
    both = BlockQuantizedLinear.stacked([first, second])
    x = torch.randn(5, 256).to(torch.bfloat16)
    assert torch.equal(both(x), torch.cat([layer(x) for layer in layers], dim=-1))
    assert [part.format for part in both.blocks.parts] == ["Q4_K", "Q6_K", "Q5_0", "Q8_0"]


@needs_block_kernel
def test_siblings_across_formats_stack_only_in_whole_tiles_and_on_the_int8_kernel():
    q4_k, q6_k = _weight("Q4_K", 32, 256, 0), _weight("Q6_K", 40, 256, 1)
    assert BlockQuantizedLinear.can_stack([BlockQuantizedLinear(q4_k), BlockQuantizedLinear(q6_k)])
    assert not BlockQuantizedLinear.can_stack([BlockQuantizedLinear(q6_k), BlockQuantizedLinear(q4_k)])
    q4_1 = _weight("Q4_1", 32, 256, 2)
    bf16 = [BlockQuantizedLinear(q4_1, activations="bf16"), BlockQuantizedLinear(q4_1, activations="bf16")]
    assert BlockQuantizedLinear.can_stack(bf16)  # one format: the bf16 kernel stacks it as before
    with pytest.raises(ValueError, match="whole tiles of 16"):
        StackedBlocks.of([q6_k, q4_k])


@needs_block_kernel
def test_a_layer_of_mixed_siblings_is_stacked_and_reports_each_format():
    layer = nn.Module()
    layer.q_proj, layer.k_proj, layer.v_proj = (
        BlockQuantizedLinear(_weight(f, 64, 256, i)) for i, f in enumerate(["Q4_K", "Q4_K", "Q6_K"])
    )
    x = torch.randn(3, 256).to(torch.bfloat16)
    separate = [layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)]
    assert fuse_projections(layer) == 1
    assert isinstance(layer.v_proj, ProjectionSlice)
    assert block_kernels(layer.q_proj.stacked.linear) == ["Q4_K/int8", "Q6_K/int8"]
    for name, expected in zip(("q_proj", "k_proj", "v_proj"), separate, strict=True):
        assert torch.equal(getattr(layer, name)(x), expected)
