"""Batch > 1: every sequence of a batch gets exactly the output it gets alone (greedy and sampled with
its own seed), while sequences join and leave between rounds; the packed verification forward gives
each sequence the logits and taps of its own forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.decoding.batching import BatchEngine
from diffdraft.decoding.engine import PLAIN, RoundPlan, SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.base import Proposal
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.model import TargetModel, VerifyInput
from diffdraft.trees import ChainBuilder, DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

from diffdraft_testing.batching import alone, batched, requests_for
from diffdraft_testing.drafters import tiny_dart
from diffdraft_testing.engine import make_method
from diffdraft_testing.targets import tiny_target


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3"]),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["ar", "pld", "chain", "ddtree-4", "ddtree-32", "chain+pld", "ddtree-8+pld"]),
    count=st.integers(1, 6),
    max_batch=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    vocab=st.sampled_from([48, 96]),
)
def test_each_sequence_of_a_batch_gets_the_output_it_gets_alone(
    family, seed, method, count, max_batch, temperature, vocab
):
    target = tiny_target(family, seed=seed, vocab=vocab)  # float64: packing changes no sample
    drafter, builder = make_method(method, target, [], [], 5, seed)
    engine = SpeculativeEngine(TargetModel(target), drafter, builder)
    requests = requests_for(target, seed, count)
    sampling = SamplingParams(temperature=temperature)
    expected = [alone(engine, request, sampling) for request in requests]
    assert batched(engine, requests, sampling, max_batch) == expected


@pytest.mark.parametrize("family", ["dart", "deer"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dart_and_deer_drafters_fork_one_context_per_sequence(family, temperature):
    target = tiny_target("qwen3", seed=4)
    wrapped = TargetModel(target)
    if family == "dart":
        drafter = DARTDrafter(tiny_dart(target, seed=4), wrapped)
        builder = DartTreeBuilder(DartTreeSettings(tree_size=12), None)
    else:
        drafter, builder = (
            DEERDrafter(deer_from_causal_lm(target, 2, 4, 1, None, "tiny test LM", 1), wrapped),
            DDTreeBuilder(8),
        )
    engine = SpeculativeEngine(wrapped, drafter, builder)
    requests = requests_for(target, 4, 5)
    sampling = SamplingParams(temperature=temperature)
    expected = [alone(engine, request, sampling) for request in requests]
    assert batched(engine, requests, sampling, 3) == expected


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_verification_gives_each_sequence_its_own_forward(family):
    target = TargetModel(tiny_target(family, seed=2))
    assert target.lean is not None
    layer_ids = [0, 3]
    g = torch.Generator().manual_seed(2)
    inputs, references = [], []
    for prompt_len, nodes in [(5, 1), (9, 4), (3, 6)]:
        prompt = torch.randint(1, 60, (prompt_len,), generator=g)
        tokens = torch.randint(1, 60, (nodes,), generator=g)
        tree = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool))  # a chain
        positions = torch.arange(prompt_len, prompt_len + nodes)
        caches = []
        for _ in range(2):
            cache = target.new_cache()
            target.prefill(cache, prompt, layer_ids)
            caches.append(cache)
        mask = target.attention_mask(caches[0], tree) if nodes > 1 else None
        references.append(target.verify(caches[0], tokens, positions, mask, layer_ids))
        inputs.append(VerifyInput(caches[1], tokens, positions, mask))
    outputs = target.verify_batch(inputs, layer_ids)
    for output, reference, given_input in zip(outputs, references, inputs, strict=True):
        torch.testing.assert_close(output.logits, reference.logits)
        torch.testing.assert_close(output.hidden, reference.hidden)
        assert given_input.cache.get_seq_length() == given_input.position_ids[-1] + 1


def test_a_removed_sequence_leaves_the_others_untouched():
    target = tiny_target("llama", seed=5)
    drafter, builder = make_method("ddtree-4", target, [], [], 5, 5)
    engine = SpeculativeEngine(TargetModel(target), drafter, builder)
    requests = [(prompt, 30, seed) for prompt, _, seed in requests_for(target, 5, 3)]
    sampling = SamplingParams()
    expected = alone(engine, requests[1], sampling)
    batch = BatchEngine(engine)
    sequences = []
    for prompt, max_new_tokens, seed in requests:
        stop = StopConditions(
            [target.config.vocab_size - 1], max_new_tokens, engine.target.max_context, len(prompt)
        )
        sequences.append(batch.add(SequenceSpec(prompt, stop, sampling, seed=seed))[0])
    kept = sequences[1]
    output = list(kept.generated)
    for round_ in range(100):
        if round_ == 1:  # every sequence took one round; two are cancelled
            batch.remove(sequences[0])
            batch.remove(sequences[2])
        for sequence, new in batch.step():
            if sequence is kept:
                output.extend(new)
        if not batch.active:
            break
    assert output == expected
    assert batch.active == []


class ScriptedDrafter:
    """Knows each prompt's greedy continuation and ranks it above random logits by that prompt's own
    margin (in nats): sequences of one batch that the drafter serves well and badly."""

    max_depth = 5
    target_layer_ids: list[int] = []  # noqa: RUF012

    def __init__(self, scripts: dict[tuple[int, ...], tuple[list[int], float]], vocab: int) -> None:
        self.scripts, self.vocab = scripts, vocab

    def reset(self) -> None:
        pass

    def extend_context(self, hidden, start: int) -> None:
        pass

    def fork(self) -> ScriptedDrafter:
        return self  # no per-sequence state: a proposal depends on the tokens given only

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        ids = tuple(token_ids.tolist())
        prompt = next(p for p in self.scripts if ids[: len(p)] == p)
        continuation, margin = self.scripts[prompt]
        done = len(ids) - len(prompt)  # the next token is continuation[done]
        logits = torch.randn(depth, self.vocab, generator=torch.Generator().manual_seed(len(ids)))
        for d, token in enumerate(continuation[done : done + depth]):
            logits[d, token] += margin
        return Proposal(log_probs=logits.log_softmax(-1))


def test_an_auto_budget_plans_the_batch_rounds_without_changing_any_output():
    target = TargetModel(tiny_target("qwen3", seed=6))
    greedy = SamplingParams()
    requests = [([3, 9, 4, 9], 70, 0), ([5, 2, 7], 30, 1), ([14, 30, 2], 60, 2)]
    margins = [8.0, 0.0, 8.0]  # the drafter serves the first and last well, the second badly
    plain = SpeculativeEngine(target, None, ChainBuilder())
    scripts = {
        tuple(prompt): (alone(plain, (prompt, n + 8, seed), greedy), margin)
        for (prompt, n, seed), margin in zip(requests, margins, strict=True)
    }
    # verifying costs 10 ms plus 1 ms per token; the planner has learned nothing and learns nothing here
    planner = BudgetPlanner(VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.073]]))

    def engine() -> SpeculativeEngine:
        return SpeculativeEngine(
            target, ScriptedDrafter(scripts, target.vocab_size), AutoBudgetBuilder(planner)
        )

    each = [GenerationStats() for _ in requests]
    expected = [
        alone(engine(), request, greedy, stats) for request, stats in zip(requests, each, strict=True)
    ]
    together = [GenerationStats() for _ in requests]
    assert batched(engine(), requests, greedy, 3, together) == expected
    for output, (prompt, max_new_tokens, _), stats in zip(expected, requests, each, strict=True):
        assert output == scripts[tuple(prompt)][0][:max_new_tokens]  # lossless
        assert len(stats.budgets) > 8  # refreshed more than once
    for stats in together:
        assert [forward[0] for forward in stats.verify_forwards][:2] == [3, 3]  # shared, and recorded so
        assert all(tokens > 3 for _, tokens, _ in stats.verify_forwards[:1])
    well, badly, also_well = (stats.budgets[1:] for stats in together)  # the first: all explore
    assert min(well + also_well) > max(badly)
    # the badly served sequence decodes plainly on most rounds: its drafts would cost the batch time
    skipped = sum(size == 0 for size in together[1].tree_sizes[:-1])
    assert skipped > len(together[1].tree_sizes) // 2


def test_waiting_taps_keep_no_rows_of_trees_and_copy_nothing_from_a_plain_round():
    """A sequence that does not draft holds its accepted taps until it drafts again: beside another
    sequence's tree they must not keep that tree's rows alive; in a round of one token a sequence
    every row is kept, and nothing is copied (under load, most rounds are such)."""
    target = tiny_target("llama", seed=3)
    drafter, builder = make_method("ddtree-4", target, [], [], 5, 3)
    engine = SpeculativeEngine(TargetModel(target), drafter, builder)
    batch = BatchEngine(engine)
    for prompt, _, seed in requests_for(target, 3, 2):
        stop = StopConditions([], 20, engine.target.max_context, len(prompt))
        batch.add(SequenceSpec(prompt, stop, SamplingParams(), seed=seed))
    tree, plain = batch.active

    def last_taps(sequence) -> torch.Tensor:
        return sequence.drafter._pending[-1][0]

    engine.plan = lambda sequences: [RoundPlan(), PLAIN]
    batch.step()
    assert tree.stats.tree_sizes[-1] > 0 and plain.stats.tree_sizes[-1] == 0
    taps = last_taps(plain)
    assert taps.untyped_storage().nbytes() == taps.nbytes  # a copy of its own row
    engine.plan = lambda sequences: [PLAIN, PLAIN]
    batch.step()
    assert last_taps(tree).untyped_storage().data_ptr() == last_taps(plain).untyped_storage().data_ptr()
