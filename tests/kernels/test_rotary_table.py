"""The rotary table gives the rotary module's own cos/sin, bit for bit, for any positions."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from diffdraft.kernels.attention_window import FULL, SLIDING
from diffdraft.kernels.rotary_table import FIRST_ROWS, RotaryTable, per_layer_type


def _rotary(rope: dict) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    ],
    ids=["default", "linear"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_looked_up_rows_are_the_modules_own(rope, dtype):
    rotary = _rotary(rope)
    table = RotaryTable(rotary)
    like = torch.zeros(1, 1, 64, dtype=dtype)
    assert table.static
    # a block after a long context, a tree's repeated depths, and one past the first table (it grows)
    for positions in (
        torch.arange(700, 709),
        torch.tensor([5, 6, 6, 7, 7, 7]),
        torch.tensor([3, 2 * FIRST_ROWS + 1]),
    ):
        expected = rotary(like, positions[None])
        got = table(like, positions[None])
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == dtype and torch.equal(a, b)


def test_frequencies_that_follow_the_length_are_computed_every_call():
    rotary = _rotary({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    table = RotaryTable(rotary)
    like = torch.zeros(1, 1, 64)
    positions = torch.arange(5000, 5003)[None]  # past max_position_embeddings: the frequencies change
    assert not table.static
    for a, b in zip(table(like, positions), rotary(like, positions), strict=True):
        assert torch.equal(a, b)


def test_other_devices_than_the_cpu_call_the_module():
    """A lookup reads the positions on the host: on an accelerator (or in a captured CUDA graph) the
    module computes cos/sin where they are used, and no table is built."""
    rotary = _rotary({"rope_type": "default", "rope_theta": 10000.0}).to("meta")
    table = RotaryTable(rotary)
    cos, sin = table(torch.zeros(1, 1, 64, device="meta"), torch.arange(3, device="meta")[None])
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (1, 3, 16) and not table._tables


@pytest.mark.parametrize("rope_type", ["default", "dynamic"])
def test_a_span_of_positions_is_what_a_lookup_of_them_gives(rope_type):
    table = RotaryTable(_rotary({"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}))
    like = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    for begin, end in ((0, 1), (700, 709), (FIRST_ROWS - 3, FIRST_ROWS + 4)):  # the last grows the table
        expected = table(like, torch.arange(begin, end)[None])
        for a, b in zip(table.rows(like, begin, end), expected, strict=True):
            assert a.shape == b[0].shape == (end - begin, 16) and torch.equal(a, b[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_table_per_layer_type_is_that_types_own(dtype):
    """Gemma 3's module keeps a local and a global base: each layer type's table gives the module's
    own cos/sin for that type."""
    config = Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=6, max_position_embeddings=4096
    )
    rotary = Gemma3RotaryEmbedding(config)
    assert per_layer_type(rotary) and not per_layer_type(_rotary({"rope_type": "default", "rope_theta": 1e4}))
    like = torch.zeros(1, 1, 64, dtype=dtype)
    positions = torch.tensor([3, 700, 700, 2 * FIRST_ROWS + 1])[None]
    tables = {kind: RotaryTable(rotary, kind) for kind in (FULL, SLIDING)}
    for kind, table in tables.items():
        assert table.static
        for a, b in zip(table(like, positions), rotary(like, positions, kind), strict=True):
            assert a.dtype == dtype and torch.equal(a, b)
    assert not torch.equal(tables[FULL](like, positions)[1], tables[SLIDING](like, positions)[1])
    with pytest.raises(ValueError, match="layer type"):
        RotaryTable(rotary)
