"""Log-probabilities of committed tokens: the target's own, token for token, for every method."""

from __future__ import annotations

import pytest
import torch

import diffdraft
from diffdraft.errors import InvalidRequestError
from diffdraft.generator import GenerationRequest
from diffdraft.runtime.logprobs import LogprobRecorder

from diffdraft_testing.checkpoints import make_checkpoint, save_tiny_drafter

PROMPT = "hello world, the quick"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")


@pytest.fixture(scope="module")
def drafter_dir(checkpoint, tmp_path_factory):
    return save_tiny_drafter(checkpoint, tmp_path_factory.mktemp("drafter"))


def test_the_recorder_keeps_each_row_s_log_softmax_at_its_token_and_the_top_alternatives():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    recorder = LogprobRecorder(top=2)
    recorder.record(logits, [4, 1])  # a stop cut the third token: its row is left out
    expected = logits.log_softmax(-1)
    assert [t.token_id for t in recorder.tokens] == [4, 1]
    for row, token in zip(expected, recorder.tokens, strict=False):
        assert token.logprob == pytest.approx(float(row[token.token_id]))
        values, ids = row.topk(2)
        assert [i for i, _ in token.top] == ids.tolist()
        assert [v for _, v in token.top] == pytest.approx(values.tolist())
    none_on_top = LogprobRecorder(top=0)
    none_on_top.record(logits, [0, 1, 2])
    assert all(t.top == [] for t in none_on_top.tokens)
    with pytest.raises(ValueError, match="top must be in"):
        LogprobRecorder(top=21)


@pytest.mark.parametrize(
    ("method", "temperature"), [("ar", 0.0), ("ddtree", 0.0), ("ddtree+pld", 0.0), ("chain", 0.9)]
)
def test_every_committed_token_gets_the_target_s_teacher_forced_log_probability(
    checkpoint, drafter_dir, method, temperature
):
    generator = diffdraft.load(
        checkpoint, drafter=None if method == "ar" else drafter_dir, method=method, budget=8
    )
    result = generator.generate(
        PROMPT, max_new_tokens=20, ignore_eos=True, temperature=temperature, seed=3, logprobs=3
    )
    if method != "ar":
        assert max(result.stats.acceptance_lengths) > 1, "no round accepted a draft: the test shows nothing"
    ids = torch.tensor(result.prompt_token_ids + result.token_ids)
    with torch.no_grad():
        forward = generator.loaded.model(ids[None]).logits[0].float().log_softmax(-1)
    start = len(result.prompt_token_ids) - 1
    assert [t.token_id for t in result.logprobs] == result.token_ids
    for position, token in enumerate(result.logprobs):
        row = forward[start + position]
        assert token.logprob == pytest.approx(float(row[token.token_id]), abs=1e-4)
        values, top_ids = row.topk(3)
        assert [i for i, _ in token.top] == top_ids.tolist()
        assert [v for _, v in token.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_streamed_chunks_carry_the_log_probabilities_of_their_tokens(checkpoint, drafter_dir):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=8)
    chunks = list(generator.stream(prompt=PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=0))
    result = chunks[-1].result
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [t for c in chunks for t in c.logprobs] == result.logprobs
    assert len(result.logprobs) == len(result.token_ids) == 16
    assert "logprobs" in result.to_dict()


def test_a_stop_cut_keeps_one_log_probability_per_kept_token(checkpoint, drafter_dir):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=8)
    whole = generator.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    stop = whole.text[len(whole.text) // 2 :][:3]
    cut = generator.generate(PROMPT, max_new_tokens=20, ignore_eos=True, stop=[stop], logprobs=1)
    assert cut.stats.stop_reason == "stop_string" and len(cut.token_ids) < 20
    assert [t.token_id for t in cut.logprobs] == cut.token_ids


def test_a_batch_gives_each_request_the_log_probabilities_it_gets_alone(checkpoint, drafter_dir):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=8)
    requests = [
        GenerationRequest(prompt=p, max_new_tokens=12, ignore_eos=True, logprobs=2)
        for p in (PROMPT, "once upon a time", "def f(x):")
    ]
    together = generator.generate_batch(requests, max_batch_size=3)
    for request, result in zip(requests, together, strict=True):
        alone = generator.generate(request.prompt, max_new_tokens=12, ignore_eos=True, logprobs=2)
        assert result.token_ids == alone.token_ids
        for a, b in zip(result.logprobs, alone.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


@pytest.mark.parametrize("logprobs", [-1, 21, 2.5, "3", True])
def test_a_bad_logprobs_count_is_a_clear_error(checkpoint, logprobs):
    generator = diffdraft.load(checkpoint, method="ar")
    with pytest.raises(InvalidRequestError, match="logprobs must be None or the number of top alternatives"):
        generator.generate(PROMPT, max_new_tokens=2, logprobs=logprobs)
