"""Speculation over a Q4_1 target stays lossless: every method's greedy tokens are plain decoding's on
the same layers, up to bf16 near-ties that a float32 copy of the same weights explains."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.bench.lossless import TIE_TOLERANCE, LosslessChecker
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear, BlockWeight, Q8Weight
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.engine import speculated_tokens
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target


@needs_block_kernel
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2"]),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["chain", "ddtree", "ddtree+pld"]),
    prompt_len=st.integers(1, 20),
    budget=st.integers(1, 24),
    q8_head=st.booleans(),
)
def test_greedy_tokens_are_plain_decodings(family, seed, method, prompt_len, budget, q8_head):
    model, dense = q4_1_target(family, seed=seed, vocab=96)
    if q8_head:
        _q8_head(model, dense)
    fuse_projections(model)
    target = TargetModel(model)
    prompt = torch.randint(1, 95, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = speculated_tokens(target, None, ChainBuilder(), prompt, 24)
    draft_vocab = list(range(0, 96, 2)) if q8_head else None
    drafter = DFlashDrafter(tiny_drafter(model, seed, block_size=5, draft_vocab=draft_vocab), target)
    if method.endswith("+pld"):
        drafter = LookupBoostedDrafter(drafter)
    builder = ChainBuilder() if method == "chain" else DDTreeBuilder(budget)
    ours = speculated_tokens(target, drafter, builder, prompt, 24)
    divergence = LosslessChecker(lambda: dense, TIE_TOLERANCE[torch.bfloat16]).check(prompt, reference, ours)
    assert divergence is None or divergence.explained, divergence


def _q8_head(model: torch.nn.Module, dense: torch.nn.Module) -> None:
    """Put the target's LM head on Q8_0 blocks (as a GGUF's), the dense copy on the same weights."""
    head = BlockQuantizedLinear(Q8Weight.quantize(model.lm_head.weight))
    model.lm_head = head
    dense.lm_head.weight.data = head.blocks.dequantize()


@needs_block_kernel
def test_a_drafter_beside_an_int8_target_drafts_on_q4_1_blocks_and_the_targets_head_rows_rounded_to_them():
    model, dense = q4_1_target("llama", vocab=96)
    _q8_head(model, dense)
    fuse_projections(model)
    target = TargetModel(model)
    vocab = [1, 7, 30, 95]
    drafter = DFlashDrafter(tiny_drafter(model, variant=DFLARE, draft_vocab=vocab), target)
    linears = [m for m in drafter.model.layers.modules() if isinstance(m, BlockQuantizedLinear)]
    assert linears and all(layer.blocks.format == "Q4_1" for layer in linears)
    assert not any(isinstance(m, torch.nn.Linear) for m in drafter.model.layers.modules())
    assert isinstance(drafter.model.fusion, torch.nn.Linear)  # a weight, never called: stays as it is
    head_rows = model.lm_head.blocks.rows(torch.tensor(vocab))
    assert drafter.head.blocks.format == "Q4_1" and model.lm_head.blocks.format == "Q8_0"  # the target's kept
    assert torch.equal(drafter.head.blocks.codes, BlockWeight.quantize(head_rows.dequantize()).codes)
    x = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    rounded = torch.nn.functional.linear(x.float(), drafter.head.blocks.dequantize())  # int8 inputs aside
    torch.testing.assert_close(drafter.head(x).float(), rounded, rtol=0, atol=0.05)
    whole = DFlashDrafter(tiny_drafter(model, variant=DFLARE), target)  # no draft vocabulary
    assert whole.head is model.lm_head  # the target's own head, shared as it is
