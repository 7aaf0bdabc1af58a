"""Resuming an interrupted benchmark: finished turns are replayed, only the rest runs again."""

from __future__ import annotations

import pytest

from diffdraft.bench.journal import JOURNAL, Journal
from diffdraft.bench.runner import BenchOptions, run_benchmark
from diffdraft.data.samples import Sample
from diffdraft.errors import InvalidRequestError

from diffdraft_testing.bench import TEMPLATE, Stub, checker
from diffdraft_testing.checkpoints import tiny_tokenizer

FINGERPRINT = {"command": "diffdraft bench --methods ar,pld", "cpu": "test cpu"}


class Interrupted(Exception):
    pass


class Crashing(Stub):
    """A stub that dies on its ``crash_at``-th call, as a killed run would."""

    def __init__(self, *args, crash_at: int) -> None:
        super().__init__(*args)
        self.crash_at = crash_at

    def generate(self, request):
        if len(self.log) + 1 == self.crash_at:
            raise Interrupted
        return super().generate(request)


@pytest.fixture
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def samples(tokenizer) -> list[Sample]:
    chat = Sample("c", "chat", messages=[{"role": "user", "content": "hello"}], followups=["the quick"])
    return [Sample("p", "set", prompt="hello world"), chat]


def test_a_resumed_run_replays_finished_turns_and_runs_only_the_rest(tokenizer, tmp_path):
    reply = tokenizer("brown fox")["input_ids"]
    options = BenchOptions(max_new_tokens=8, repeats=2, warmup_tokens=1, progress=False)
    full_log: list = []
    full = run_benchmark(
        [Stub("ar", full_log, reply), Stub("pld", full_log, reply)],
        samples(tokenizer),
        tokenizer,
        checker(),
        options,
    )

    log: list = []
    # warm-up (2 calls) + 3 finished turns of 2 methods, then the 10th call dies mid-turn
    crashing = [Crashing("ar", log, reply, crash_at=10), Stub("pld", log, reply)]
    with pytest.raises(Interrupted):
        run_benchmark(
            crashing, samples(tokenizer), tokenizer, checker(), options, Journal(tmp_path, FINGERPRINT, False)
        )
    resumed_log: list = []
    runners = [Stub("ar", resumed_log, reply), Stub("pld", resumed_log, reply)]
    journal = Journal(tmp_path, FINGERPRINT, resume=True)
    assert len(journal.finished) == 3
    run = run_benchmark(runners, samples(tokenizer), tokenizer, checker(), options, journal)

    assert len(resumed_log) == 2 + 2 * 3  # warm-up + the 3 turns that had not finished
    assert resumed_log[2:] == full_log[-6:]  # the follow-up prompt is built from the replayed reply
    assert [(r.key, r.method, r.completion.token_ids) for r in run.records] == [
        (r.key, r.method, r.completion.token_ids) for r in full.records
    ]
    journal.close()
    assert not (tmp_path / JOURNAL).exists()


def test_resuming_under_other_settings_refuses_and_names_them(tmp_path):
    Journal(tmp_path, FINGERPRINT, resume=False)
    with pytest.raises(InvalidRequestError, match=r"\(cpu differ\).*without --resume"):
        Journal(tmp_path, FINGERPRINT | {"cpu": "another cpu"}, resume=True)
    assert Journal(tmp_path, FINGERPRINT | {"cpu": "another cpu"}, resume=False).finished == {}


def test_a_cut_short_last_line_runs_that_turn_again(tokenizer, tmp_path):
    options = BenchOptions(max_new_tokens=4, warmup_tokens=1, progress=False)
    sample = [Sample("p", "set", prompt="hello world")]
    run_benchmark(
        [Stub("ar", [], [2, 3])], sample, tokenizer, checker(), options, Journal(tmp_path, FINGERPRINT, False)
    )
    path = tmp_path / JOURNAL
    path.write_text(path.read_text()[:-20])
    journal = Journal(tmp_path, FINGERPRINT, resume=True)
    assert journal.finished == {}
    run_benchmark([Stub("ar", [], [2, 3])], sample, tokenizer, checker(), options, journal)
    assert len(Journal(tmp_path, FINGERPRINT, resume=True).finished) == 1  # appended after a clean cut
