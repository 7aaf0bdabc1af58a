"""The benchmark loop with stand-in methods: interleaving, warm-up, follow-up turns, planted mismatches."""

from __future__ import annotations

import pytest

from diffdraft.bench.runner import BenchOptions, run_benchmark
from diffdraft.data.samples import Sample
from diffdraft.errors import InvalidRequestError

from diffdraft_testing.bench import TEMPLATE, Stub, checker
from diffdraft_testing.checkpoints import tiny_tokenizer


@pytest.fixture
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_methods_are_interleaved_per_prompt_after_a_warm_up(tokenizer):
    log: list = []
    runners = [Stub(name, log, [2, 3, 4]) for name in ("ar", "pld", "ddtree:8")]
    samples = [Sample(f"s{i}", "set", prompt=f"hello {i}") for i in range(3)]
    options = BenchOptions(max_new_tokens=3, repeats=2, warmup_tokens=1, progress=False)
    run = run_benchmark(runners, samples, tokenizer, checker(), options)
    assert [(m, n) for m, _, n, _ in log[:3]] == [("ar", 1), ("pld", 1), ("ddtree:8", 1)]
    timed = [m for m, _, n, _ in log[3:]]
    assert timed[:6] == ["ar", "pld", "ddtree:8", "pld", "ddtree:8", "ar"]  # the order rotates
    assert len(run.records) == 3 * 2 * 3
    assert {r.repeat for r in run.records} == {0, 1}
    assert all(r.compared == (r.method != "ar") and r.divergence is None for r in run.records)
    assert not run.violations


def test_a_follow_up_turn_is_asked_after_the_reference_reply(tokenizer):
    log: list = []
    reply = tokenizer("brown fox")["input_ids"]
    runners = [Stub("ar", log, reply), Stub("pld", log, reply)]
    samples = [Sample("q", "chat", messages=[{"role": "user", "content": "hello"}], followups=["the quick"])]
    run = run_benchmark(
        runners, samples, tokenizer, checker(), BenchOptions(max_new_tokens=8, progress=False)
    )
    second = tokenizer.decode(list(log[-1][1]))
    assert second == "user: hello\nassistant: brown fox\nuser: the quick\nassistant: "
    assert [r.turn for r in run.records] == [0, 0, 1, 1]


def test_a_planted_mismatch_is_caught_and_a_near_tie_is_explained(tokenizer):
    # The float32 stand-in ranks token 2 first, then 3 (gap 1.0), then 1 (gap 4.0).
    samples = [Sample("s", "set", prompt="hello")]
    options = BenchOptions(max_new_tokens=4, progress=False)
    log: list = []
    broken = [Stub("ar", log, [2, 2, 2, 2]), Stub("hf", log, [2, 2, 2, 2], off_at=2)]  # token 3 at 2
    run = run_benchmark(broken, samples, tokenizer, checker(tolerance=0.5), options)
    [bad] = run.violations
    assert bad.method == "hf" and bad.divergence["position"] == 2
    assert bad.divergence["margin"] == pytest.approx(1.0) and not bad.divergence["explained"]
    assert not run_benchmark(broken, samples, tokenizer, checker(tolerance=1.5), options).violations


def test_sampled_runs_are_not_compared_and_vary_the_seed_per_repeat(tokenizer):
    log: list = []
    runners = [Stub("ar", log, [2, 3]), Stub("pld", log, [2, 4])]
    options = BenchOptions(max_new_tokens=2, temperatures=(0.7,), repeats=2, seed=5, progress=False)
    run = run_benchmark(runners, [Sample("s", "set", prompt="hi")], tokenizer, checker(), options)
    assert not any(r.compared for r in run.records)
    assert sorted({seed for *_, seed in log[2:]}) == [5, 6]


def test_the_reference_method_is_required(tokenizer):
    with pytest.raises(InvalidRequestError, match="plain AR"):
        run_benchmark(
            [Stub("pld", [], [1])], [Sample("s", "d", prompt="x")], tokenizer, checker(), BenchOptions()
        )
