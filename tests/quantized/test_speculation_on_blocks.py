"""Speculation over a Q4_1 target stays lossless: every method's greedy tokens are plain decoding's on
the same layers, up to bf16 near-ties that a float32 copy of the same weights explains."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.bench.lossless import TIE_TOLERANCE, LosslessChecker
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.engine import SpeculativeEngine
from diffdraft.fused_projections import fuse_projections
from diffdraft.sampling import SamplingParams
from diffdraft.stats import GenerationStats
from diffdraft.stopping import StopConditions
from diffdraft.target import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder

from conftest import needs_block_kernel, q4_1_target, tiny_drafter


def _generate(target: TargetModel, drafter, builder, prompt: list[int], max_new_tokens: int) -> list[int]:
    config = target.model.config
    stop = StopConditions([config.eos_token_id], max_new_tokens, config.max_position_embeddings, len(prompt))
    engine = SpeculativeEngine(target, drafter, builder)
    return [t for chunk in engine.run(prompt, stop, SamplingParams(), GenerationStats()) for t in chunk]


@needs_block_kernel
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2"]),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["chain", "ddtree", "ddtree+pld"]),
    prompt_len=st.integers(1, 20),
    budget=st.integers(1, 24),
)
def test_greedy_tokens_are_plain_decodings(family, seed, method, prompt_len, budget):
    model, dense = q4_1_target(family, seed=seed, vocab=96)
    fuse_projections(model)
    target = TargetModel(model)
    prompt = torch.randint(1, 95, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = _generate(target, None, ChainBuilder(), prompt, 24)
    drafter = DFlashDrafter(tiny_drafter(model, seed, block_size=5), target)
    if method.endswith("+pld"):
        drafter = LookupBoostedDrafter(drafter)
    builder = ChainBuilder() if method == "chain" else DDTreeBuilder(budget)
    ours = _generate(target, drafter, builder, prompt, 24)
    divergence = LosslessChecker(lambda: dense, TIE_TOLERANCE[torch.bfloat16]).check(prompt, reference, ours)
    assert divergence is None or divergence.explained, divergence
