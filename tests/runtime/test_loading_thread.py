"""The warning for CPU generation outside the loading thread: once, only from another thread, only
where kernels run on a pool of threads; the output is unchanged."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import diffdraft
from diffdraft.runtime.loading_thread import SLOW_THREAD_WARNING

from diffdraft_testing.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama")


def in_thread(call):
    """``call()``'s result and the warnings it raised, run in a new thread."""
    outcome = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome["result"] = call()
        outcome["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return outcome["result"], outcome["warnings"]


def test_another_thread_is_warned_once_and_gets_the_same_output(checkpoint, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    generator = diffdraft.load(checkpoint, method="pld")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loading thread is never warned
        expected = generator.generate("hello world", max_new_tokens=8, ignore_eos=True).token_ids
    result, warned = in_thread(lambda: generator.generate("hello world", max_new_tokens=8, ignore_eos=True))
    assert result.token_ids == expected
    assert warned == [SLOW_THREAD_WARNING]
    results, warned_again = in_thread(lambda: generator.generate_batch(["hello world"], 1))
    assert results[0].token_ids and warned_again == []  # once per generator


def test_no_warning_where_kernels_run_in_the_calling_thread_alone(checkpoint, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    generator = diffdraft.load(checkpoint, method="ar")
    _, warned = in_thread(lambda: generator.generate_batch(["hello"], 1))
    assert warned == []


def test_a_scheduler_started_in_its_own_thread_is_warned_too(checkpoint, monkeypatch):
    from diffdraft.serve.scheduler import Scheduler

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    generator = diffdraft.load(checkpoint, method="ar")
    scheduler = Scheduler(generator, max_batch_size=1).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # raised in the scheduler's thread
        assert list(scheduler.submit(diffdraft.GenerationRequest("hello", max_new_tokens=2)))[-1].result
    scheduler.close()
    assert generator.engine.loading_thread.warned
