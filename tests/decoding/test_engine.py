"""The loop's promise: every method reproduces the target's own greedy output token for token."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.drafters.base import Proposal
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.trees import ChainBuilder

from diffdraft_testing.engine import METHODS, OracleDrafter, make_method, run_engine
from diffdraft_testing.targets import hf_greedy, tiny_target


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(METHODS),
    prompt_len=st.integers(1, 24),
    block_size=st.integers(2, 7),
    max_new_tokens=st.integers(1, 40),
    eos_is_frequent=st.booleans(),
)
def test_greedy_output_identical_to_transformers_generate(
    family, seed, method, prompt_len, block_size, max_new_tokens, eos_is_frequent
):
    target = tiny_target(family, seed=seed, vocab=48 if eos_is_frequent else 96)
    g = torch.Generator().manual_seed(seed)
    # repeat a short motif so prompt lookup finds matches
    motif = torch.randint(1, target.config.vocab_size - 1, (max(1, prompt_len // 3),), generator=g).tolist()
    prompt = (motif * 3 + [5])[:prompt_len]
    eos = target.config.vocab_size - 1
    reference = hf_greedy(target, prompt, max_new_tokens, eos)
    drafter, builder = make_method(method, target, reference, prompt, block_size, seed)
    ours, stats = run_engine(target, drafter, builder, prompt, max_new_tokens, eos)
    assert ours == reference
    assert sum(stats.acceptance_lengths) + 1 >= len(ours)
    assert stats.stop_reason == ("eos" if reference[-1] == eos else "max_new_tokens")


@pytest.mark.parametrize("method", ["chain", "ddtree-4", "oracle-chain", "oracle-ddtree"])
def test_oracle_and_drafters_accept_more_than_one_token_per_round(method):
    target = tiny_target("qwen3", seed=3)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    reference = hf_greedy(target, prompt, 30, None)
    drafter, builder = make_method(method, target, reference, prompt, 5, seed=3)
    ours, stats = run_engine(target, drafter, builder, prompt, 30, target.config.vocab_size - 1)
    assert ours == reference[: len(ours)]
    if method.startswith("oracle"):
        assert stats.tau > 2.0, stats.acceptance_histogram


def test_a_small_ddtree_has_its_drafter_propose_only_the_positions_it_can_reach():
    target = tiny_target("llama", seed=4)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    reference = hf_greedy(target, prompt, 24, None)
    for method, reach in (("ddtree-2", 2), ("ddtree-2+pld", 2), ("ddtree-32", 6)):
        drafter, builder = make_method(method, target, reference, prompt, block_size=7, seed=4)
        ours, stats = run_engine(target, drafter, builder, prompt, 24, target.config.vocab_size - 1)
        assert ours == reference[: len(ours)]
        # the last rounds may draft less: only the tokens left to generate are drafted for
        assert max(stats.draft_depths) == reach and max(stats.draft_depths[:-3]) == reach, method


class PromptTakingDrafter(OracleDrafter):
    """An oracle that, like a real drafter, takes the prompt in on its first proposal (here: a pause)."""

    pause = 0.2
    took_prompt = False

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        if not self.took_prompt:
            time.sleep(self.pause)
            self.took_prompt = True
        return super().propose(token_ids, depth)


def test_a_sequences_first_drafting_round_is_timed_apart():
    """The round planner leaves the prompt's one-off intake out of a drafting round's cost."""
    target = tiny_target("llama", seed=4)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    reference = hf_greedy(target, prompt, 24, None)
    drafter = PromptTakingDrafter(reference, len(prompt), target.config.vocab_size, 4, seed=4)
    ours, stats = run_engine(target, drafter, ChainBuilder(), prompt, 24, target.config.vocab_size - 1)
    assert ours == reference[: len(ours)]
    assert stats.catch_up_draft_seconds[0] >= drafter.pause
    assert stats.timings["draft"] - sum(stats.catch_up_draft_seconds) < drafter.pause


def test_stop_on_context_length():
    target = tiny_target("llama", seed=1, max_positions=20)
    prompt = list(range(1, 15))
    ours, stats = run_engine(target, PromptLookupDrafter(3), ChainBuilder(), prompt, 100, eos=10_000)
    assert len(prompt) + len(ours) == 20
    assert stats.stop_reason == "context_length"
    reference = hf_greedy(target, prompt, 6, None)
    n = min(len(ours), len(reference))
    assert ours[:n] == reference[:n]
