"""Sliding windows shorter than the prompt plus the generation: every method still reproduces the
target's own greedy output, alone and in a batch; and the windows are really exercised (a verifier
that ignored them would be caught)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.kernels.attention_window import LayerWindows
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel
from diffdraft.trees import DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

from diffdraft_testing.batching import alone, batched, requests_for
from diffdraft_testing.drafters import tiny_dart
from diffdraft_testing.engine import METHODS, make_method, run_engine
from diffdraft_testing.targets import WINDOWED_FAMILIES, hf_greedy, ignore_windows, windowed_target


def motif_prompt(target, seed: int, length: int) -> list[int]:
    """A short motif repeated, so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(1, target.config.vocab_size - 1, (max(1, length // 3),), generator=g).tolist()
    return (motif * 3 + [5])[:length]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(WINDOWED_FAMILIES),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(METHODS),
    window=st.integers(2, 6),
    prompt_len=st.integers(1, 16),
    block_size=st.integers(2, 7),
    max_new_tokens=st.integers(8, 30),
)
def test_greedy_output_under_sliding_windows_is_transformers_generate(
    family, seed, method, window, prompt_len, block_size, max_new_tokens
):
    target = windowed_target(family, window, seed=seed, vocab=96)
    prompt = motif_prompt(target, seed, prompt_len)
    reference = hf_greedy(target, prompt, max_new_tokens, None)
    drafter, builder = make_method(method, target, reference, prompt, block_size, seed)
    ours, _ = run_engine(target, drafter, builder, prompt, max_new_tokens, eos=10_000)
    assert ours == reference


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_verifier_that_ignored_the_window_would_be_caught(family, monkeypatch):
    target = windowed_target(family, 4, seed=0, vocab=96)
    prompt = motif_prompt(target, 0, 12)
    reference = hf_greedy(target, prompt, 30, None)
    ignore_windows(monkeypatch)
    for method in ["chain", "ddtree-4", "oracle-ddtree"]:
        drafter, builder = make_method(method, target, reference, prompt, 5, 0)
        ours, _ = run_engine(target, drafter, builder, prompt, 30, eos=10_000)
        assert ours != reference, method


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(WINDOWED_FAMILIES),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["pld", "chain", "ddtree-4", "ddtree-8+pld"]),
    count=st.integers(2, 5),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_each_sequence_of_a_windowed_batch_gets_the_output_it_gets_alone(
    family, seed, method, count, temperature
):
    target = windowed_target(family, 3, seed=seed, vocab=48)
    drafter, builder = make_method(method, target, [], [], 5, seed)
    engine = SpeculativeEngine(TargetModel(target), drafter, builder)
    requests = requests_for(target, seed, count)
    sampling = SamplingParams(temperature=temperature)
    expected = [alone(engine, request, sampling) for request in requests]
    assert batched(engine, requests, sampling, 3) == expected


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_dart_and_deer_drafters_of_a_windowed_target_keep_its_greedy_output(family):
    target = windowed_target(family, 3, seed=4, vocab=96)
    wrapped = TargetModel(target)
    deer = deer_from_causal_lm(target, 2, 4, 1, None, "a windowed test LM")
    assert LayerWindows.of(deer.config).window == target.config.max_position_embeddings  # no window
    drafters = {
        "dart": (
            DARTDrafter(tiny_dart(target, seed=4), wrapped),
            DartTreeBuilder(DartTreeSettings(tree_size=12)),
        ),
        "deer": (DEERDrafter(deer, wrapped), DDTreeBuilder(8)),
    }
    prompt = motif_prompt(target, 4, 14)
    reference = hf_greedy(target, prompt, 30, None)
    for name, (drafter, builder) in drafters.items():
        ours, _ = run_engine(target, drafter, builder, prompt, 30, eos=10_000)
        assert ours == reference, name
