"""Q4_0, Q5_0, Q4_K, Q5_K and Q6_K on the int8 kernel, against the ``gguf`` package's own dequantize.

The weights are random bytes (every code, scale and min a file may hold) with small float16 scales, so
each bit of each format's layout takes part; the reference is the package's dense weight times the
kernel's int8 rounding of the inputs, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear, q4_1_linear
from diffdraft.kernels.quantized.gguf_blocks import GGUF_FORMATS, GGUFBlocks
from diffdraft.kernels.quantized.tile_layout import INT8_OPS

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import GGUF_FLOAT16_FIELDS, int8_rounded_inputs, random_gguf_bytes


def random_blocks(format: str, out: int, inputs: int, seed: int = 0) -> GGUFBlocks:
    return GGUFBlocks.from_gguf(random_gguf_bytes(format, out, inputs, seed), format)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gguf package's weight [out, in] times the inputs' int8 rounding, per block, in float64."""
    codes, scales = int8_rounded_inputs(x)
    blocks = weight.double().view(weight.shape[0], -1, 32)
    return torch.einsum("rbk,obk,rb->ro", codes, blocks, scales)


def _unpacked(blocks: GGUFBlocks) -> torch.Tensor:
    """The weight rebuilt from :meth:`GGUFBlocks.codes_and_values` by ``int8_matmul.cpp``'s table."""
    codes, values = blocks.codes_and_values()
    out = blocks.out_features
    c = torch.from_numpy(codes.astype(np.float64)).view(out, -1, 32)
    v = {name: torch.from_numpy(value.astype(np.float64)) for name, value in values.items()}
    if blocks.format in ("Q4_0", "Q5_0"):
        w = v["d"][..., None] * (c - (8 if blocks.format == "Q4_0" else 16))
    elif blocks.format == "Q6_K":
        d = v["d"].repeat_interleave(16, dim=1) * v["sc"]  # per 16 inputs
        w = d.view(out, -1, 2)[..., None] * (c.view(out, -1, 2, 16) - 32)
    else:
        d, dmin = (v[name].repeat_interleave(8, dim=1) for name in ("d", "dmin"))
        w = (d * v["sc"])[..., None] * c - (dmin * v["m"])[..., None]
    return w.reshape(out, -1)


@pytest.mark.parametrize("format", GGUF_FORMATS)
def test_codes_and_values_rebuild_exactly_the_weight_the_gguf_package_reads(format):
    """Exactly, to the package's one float32 rounding of each weight."""
    blocks = random_blocks(format, 24, 512)
    assert torch.equal(_unpacked(blocks).float(), blocks.dequantize())


@needs_block_kernel
@pytest.mark.parametrize("format", GGUF_FORMATS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("rows", "out"), [(1, 16), (5, 40), (13, 33), (37, 80)])
def test_int8_outputs_are_the_gguf_weights_times_the_int8_rounded_inputs(format, bias, rows, out):
    blocks = random_blocks(format, out, 512, seed=rows)
    layer = BlockQuantizedLinear(blocks, torch.randn(out) if bias else None)
    x = torch.randn(rows, 512).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero block has scale 0
    x[-1, 37] = 9.0  # an outlier coarsens only its own block
    added = layer.bias.double() if bias else 0
    expected = reference(x, blocks.dequantize()) + added
    # bf16 outputs (2^-8 relative), float32 products and sums in between
    magnitude = reference(x.abs(), blocks.dequantize().abs()).amax()
    torch.testing.assert_close(layer(x).double(), expected, rtol=2**-8, atol=float(magnitude) * 1e-5)


@needs_block_kernel
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    format=st.sampled_from(GGUF_FORMATS),
    rows=st.integers(1, 30),
    out=st.integers(1, 70),
    supers=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_rows_match_the_reference_and_each_row_its_own_decode(format, rows, out, supers, seed):
    """Random shapes: outputs that end mid-tile, one to three super-blocks of inputs; each row of a
    call has the bits it gets alone (what a tree verification shares with a plain decode step)."""
    inputs = 256 * supers
    blocks = random_blocks(format, out, inputs, seed)
    layer = BlockQuantizedLinear(blocks)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    together = layer(x)
    magnitude = reference(x.abs(), blocks.dequantize().abs()).amax()
    torch.testing.assert_close(
        together.double(), reference(x, blocks.dequantize()), rtol=2**-8, atol=float(magnitude) * 1e-5
    )
    for i in range(rows):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


@needs_block_kernel
@pytest.mark.parametrize("format", GGUF_FORMATS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sums_stay_exact_where_every_code_and_input_is_at_its_largest(format, sign):
    """All-ones bytes: the largest codes (and Q6_K's scale -1) against inputs of code +-127."""
    block_inputs, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    raw = np.full((32, 512 // block_inputs, size), 255, dtype=np.uint8)
    for offset in GGUF_FLOAT16_FIELDS[format]:
        raw[..., offset : offset + 2] = np.array([0.001], dtype=np.float16).view(np.uint8)
    blocks = GGUFBlocks.from_gguf(raw.reshape(32, -1), format)
    x = torch.full((9, 512), sign, dtype=torch.bfloat16)
    torch.testing.assert_close(
        BlockQuantizedLinear(blocks)(x).double(), reference(x, blocks.dequantize()), rtol=2**-8, atol=0
    )


def test_rows_and_stack_move_whole_rows():
    a, b = random_blocks("Q4_K", 20, 256, seed=1), random_blocks("Q4_K", 12, 256, seed=2)
    order = torch.tensor([19, 0, 7, 7])
    assert torch.equal(a.rows(order).dequantize(), a.dequantize()[order])
    assert torch.equal(GGUFBlocks.stack([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert (a.out_features, a.in_features) == (20, 256)


@needs_block_kernel
def test_each_format_is_numbered_for_the_fused_loop_and_drafts_round_to_q4_1():
    for format in GGUF_FORMATS:
        layer = BlockQuantizedLinear(random_blocks(format, 32, 256))
        tiles, width, number, bias = layer.int8_operands()
        assert INT8_OPS[number] == format and (tiles.shape[0], width, bias) == (2, 32, None)
        drafted = q4_1_linear(layer)  # a target's head rows a drafter borrows
        assert drafted.blocks.format == "Q4_1" and drafted.out_features == 32


def test_a_format_it_does_not_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="Q5_1"):
        GGUFBlocks.from_gguf(np.zeros((1, 24), dtype=np.uint8), "Q5_1")
