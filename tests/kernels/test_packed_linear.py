"""Packed weights change the speed, never a number: layers, whole targets and drafted generations."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.kernels.packed_linear import (
    PackedLinear,
    has_packed_layers,
    pack_linear_layers,
    packing_supported,
)
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.model import TargetModel
from diffdraft.trees import DDTreeBuilder

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.markers import needs_packing
from diffdraft_testing.targets import tiny_target


@needs_packing
@pytest.mark.parametrize(("rows", "inputs", "bias"), [(7, 5, False), (96, 32, True), (300, 64, False)])
@pytest.mark.parametrize("leading", [(1,), (9,), (2, 17)])
def test_a_packed_layer_gives_the_stock_layers_exact_output(rows, inputs, bias, leading):
    torch.manual_seed(rows)
    linear = nn.Linear(inputs, rows, bias=bias).to(torch.bfloat16)
    x = torch.randn(*leading, inputs, dtype=torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    assert torch.equal(packed(x), linear(x))
    assert torch.equal(packed.weight, linear.weight)
    assert packed.state_dict().keys() == linear.state_dict().keys()


@needs_packing
def test_a_packed_target_keeps_its_logits_and_its_state_dict():
    stock = tiny_target(dtype=torch.bfloat16, vocab=96, hidden=64)
    packed = copy.deepcopy(stock)
    count = pack_linear_layers(packed)
    assert count == sum(type(m) is nn.Linear for m in stock.modules()) == 4 * 7 + 1
    assert has_packed_layers(packed) and not has_packed_layers(stock)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, stock(ids).logits)
    expected = stock.state_dict()
    got = packed.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_only_bfloat16_on_cpu_is_packed():
    model = tiny_target(dtype=torch.float32)
    assert pack_linear_layers(model) == 0
    assert not packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("cuda"))


def _ddtree_tokens(target_model: nn.Module, drafter_model, prompt: list[int]):
    """Greedy DDTree-8 tokens and the drafter the run packed (or not) alongside the target."""
    target = TargetModel(target_model)
    drafter = DFlashDrafter(drafter_model, target)
    engine = SpeculativeEngine(target, drafter, DDTreeBuilder(8))
    stop = StopConditions([], 24, target_model.config.max_position_embeddings, len(prompt))
    chunks = engine.run(SequenceSpec(prompt, stop))
    return [t for chunk in chunks for t in chunk], drafter


@needs_packing
def test_a_packed_target_packs_its_drafter_and_generates_the_same_tokens():
    stock = tiny_target(dtype=torch.bfloat16, vocab=96, hidden=64)
    drafter = tiny_drafter(stock, block_size=4, variant=DFLARE, draft_vocab=list(range(0, 96, 2)))
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    expected, stock_drafter = _ddtree_tokens(stock, copy.deepcopy(drafter), prompt)
    packed = copy.deepcopy(stock)
    pack_linear_layers(packed)
    got, packed_drafter = _ddtree_tokens(packed, drafter, prompt)
    assert got == expected and len(got) == 24
    assert has_packed_layers(packed_drafter.model) and isinstance(packed_drafter.head, PackedLinear)
    assert not has_packed_layers(stock_drafter.model)
