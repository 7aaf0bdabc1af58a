"""A request that fails on its own fails alone: the other requests of its batch finish with exactly
the output they get alone, and the scheduler goes on serving."""

from __future__ import annotations

import pytest

import diffdraft
from diffdraft import GenerationRequest
from diffdraft.serve.scheduler import Scheduler

from diffdraft_testing.checkpoints import make_checkpoint

REQUESTS = [
    GenerationRequest("hello world", max_new_tokens=12, ignore_eos=True),
    GenerationRequest("the quick brown", max_new_tokens=9, ignore_eos=True),
    GenerationRequest("fox", max_new_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
    GenerationRequest("world", max_new_tokens=8, ignore_eos=True),
]
POISONED = 1


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return diffdraft.load(make_checkpoint(tmp_path_factory.mktemp("target"), "llama"), method="pld")


@pytest.fixture(scope="module")
def alone(generator):
    return [generator.generate(**vars(request)) for request in REQUESTS]


class Injected(RuntimeError):
    pass


def fail_second_call(owner, name: str, running: list[int], scheduler: Scheduler) -> None:
    """``owner.name`` raises :class:`Injected` on its second call (noting how many requests ran)."""
    method, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            running.append(scheduler.running)
            raise Injected(f"{name} failed (injected)")
        return method(*args, **kwargs)

    setattr(owner, name, failing)


@pytest.mark.parametrize("stage", ["build", "commit", "text"])
def test_a_request_failing_in_a_batch_fails_alone(generator, alone, monkeypatch, stage):
    """``build``: its tree; ``commit``: accepting and committing its tokens (both inside the shared
    round); ``text``: decoding its tokens' text, after the round."""
    scheduler = Scheduler(generator, max_batch_size=len(REQUESTS))  # not started: all join one batch
    prepared = [generator.prepare(request) for request in REQUESTS]
    running: list[int] = []
    if stage == "text":
        fail_second_call(prepared[POISONED], "add", running, scheduler)
    else:
        start = generator.engine.start

        def start_poisoned(spec, drafter=None):
            sequence = start(spec, drafter)
            if spec is prepared[POISONED].spec:
                fail_second_call(sequence, stage, running, scheduler)
            return sequence

        monkeypatch.setattr(generator.engine, "start", start_poisoned)
    handles = [scheduler.submit(request) for request in prepared]
    scheduler.start()
    try:
        with pytest.raises(Injected, match="injected"):
            list(handles[POISONED])
        for i, handle in enumerate(handles):
            if i != POISONED:
                chunks = list(handle)
                result = chunks[-1].result
                assert "".join(c.text for c in chunks) == result.text == alone[i].text
                assert result.token_ids == alone[i].token_ids
        assert running == [len(REQUESTS)]  # it failed with the whole batch running
        again = list(scheduler.submit(REQUESTS[0]))[-1].result
        assert again.token_ids == alone[0].token_ids
        assert scheduler.alive and scheduler.running == scheduler.queue_depth == 0
    finally:
        scheduler.close()
