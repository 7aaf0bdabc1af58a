"""Forward probes: rounds and verification sizes recovered from the forwards a generation made."""

from __future__ import annotations

import numpy as np
import torch

from diffdraft.bench.probes import ForwardCall, ForwardProbe, TimedNgram, rounds_from_calls

from diffdraft_testing.ngram import PerContextLookups
from diffdraft_testing.targets import tiny_target


def test_rounds_are_recovered_from_cache_lengths():
    # prompt of 5; prefill, then rounds committing 3, 1 and (the last, ending at 5 + 7 tokens) 2 tokens
    calls = [ForwardCall(0, 5, 0.1), ForwardCall(5, 4, 0.1), ForwardCall(8, 4, 0.1), ForwardCall(9, 4, 0.1)]
    assert rounds_from_calls(calls, prompt_length=5, generated=7) == [3, 1, 2]


def test_a_prefill_that_also_verified_candidates_is_a_round():
    # HF assisted decoding verifies its first candidates in the prefill forward (5 prompt + 3 drafted)
    calls = [ForwardCall(0, 8, 0.1), ForwardCall(7, 4, 0.1)]
    assert rounds_from_calls(calls, prompt_length=5, generated=4) == [3, 1]


def test_the_probe_sees_every_forward_of_hf_generate_and_detaches():
    model = tiny_target(dtype=torch.float32)
    prompt = torch.tensor([[1, 2, 3, 4]])
    with ForwardProbe(model) as probe:
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
        )
    generated = out.shape[1] - prompt.shape[1]
    assert [(c.cached, c.tokens) for c in probe.calls[:2]] == [(0, 4), (4, 1)]
    assert rounds_from_calls(probe.calls, 4, generated) == [1] * (generated - 1)
    assert all(c.seconds > 0 for c in probe.calls)
    model(prompt)
    assert len(probe.calls) == generated  # hooks are gone after the block


class FakeTrie(PerContextLookups):
    order = 3
    path = "trie"

    def log_probs(self, context, tokens):
        return np.full(len(tokens), -float(len(context)), dtype=np.float32)


def test_timed_ngram_answers_like_the_trie_and_times_each_lookup():
    timed = TimedNgram(FakeTrie())
    assert timed.order == 3 and timed.path == "trie"
    assert timed.log_probs([1, 2], [5, 6, 7]).tolist() == [-2.0, -2.0, -2.0]
    timed.log_probs([1], [5])
    seconds = timed.take()
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    assert timed.take() == []
    assert timed.log_probs_many([[1], [1, 2, 3]], [5]).tolist() == [[-1.0], [-3.0]]
    assert len(timed.take()) == 2  # a beam's lookups at once count as one lookup per context
