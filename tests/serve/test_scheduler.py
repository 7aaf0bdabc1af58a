"""The scheduler: concurrent clients each get the result they would get alone, a bounded queue,
cancellation that frees the slot, bad requests refused at submit, and a clean shutdown."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import diffdraft
from diffdraft import GenerationRequest
from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.serve.scheduler import QueueFullError, RequestCancelledError, Scheduler, SchedulerClosedError

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_drafter


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("target"), "llama")
    target = diffdraft.load(checkpoint).loaded.model
    drafter = tmp_path_factory.mktemp("drafter")
    save_draft_model(tiny_drafter(target, block_size=4).float(), drafter)
    return diffdraft.load(checkpoint, drafter=drafter, method="ddtree+pld", budget=6)


REQUESTS = [
    GenerationRequest("hello world", max_new_tokens=20, ignore_eos=True),
    GenerationRequest("the quick brown", max_new_tokens=7, ignore_eos=True),
    GenerationRequest("fox", max_new_tokens=15, temperature=0.8, seed=5, ignore_eos=True),
    GenerationRequest("world", max_new_tokens=3, ignore_eos=True),
    GenerationRequest(
        "brown fox the", max_new_tokens=11, temperature=1.0, top_p=0.9, seed=2, ignore_eos=True
    ),
    GenerationRequest("quick", max_new_tokens=9),
]


def test_concurrent_clients_each_get_the_result_they_get_alone(generator):
    expected = [generator.generate(**vars(request)) for request in REQUESTS]
    scheduler = Scheduler(generator, max_batch_size=3).start()
    results: dict[int, tuple[str, list[int]]] = {}

    def client(index: int) -> None:
        chunks = list(scheduler.submit(REQUESTS[index]))
        results[index] = ("".join(chunk.text for chunk in chunks), chunks[-1].result.token_ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(REQUESTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    scheduler.close()
    assert [results[i] for i in range(len(REQUESTS))] == [(e.text, e.token_ids) for e in expected]
    assert scheduler.running == scheduler.queue_depth == 0


def test_async_clients_are_served_through_their_event_loop(generator):
    expected = [generator.generate(**vars(request)).text for request in REQUESTS[:3]]
    scheduler = Scheduler(generator, max_batch_size=2).start()

    async def client(request: GenerationRequest) -> str:
        return "".join([chunk.text async for chunk in scheduler.submit(request)])

    async def main() -> list[str]:
        return await asyncio.gather(*(client(request) for request in REQUESTS[:3]))

    try:
        assert asyncio.run(main()) == expected
    finally:
        scheduler.close()


def test_a_full_queue_and_a_bad_request_are_refused_at_submit(generator):
    scheduler = Scheduler(generator, max_queue=2)  # not started: requests wait
    scheduler.submit(REQUESTS[0])
    scheduler.submit(REQUESTS[1])
    with pytest.raises(QueueFullError, match="queue holds 2"):
        scheduler.submit(REQUESTS[2])
    with pytest.raises(diffdraft.InvalidRequestError, match="temperature must be >= 0"):
        scheduler.submit(GenerationRequest("hi", temperature=-1.0))
    assert scheduler.queue_depth == 2


def test_a_cancelled_request_frees_its_slot_and_the_others_finish(generator):
    expected = generator.generate(**vars(REQUESTS[1]))
    scheduler = Scheduler(generator, max_batch_size=1).start()  # one slot: the second waits for it
    endless = scheduler.submit(GenerationRequest("hello", max_new_tokens=100_000, ignore_eos=True))
    next(iter(endless))
    waiting = scheduler.submit(REQUESTS[1])
    gone = scheduler.submit(REQUESTS[2])  # cancelled while it waits: its reader is told, not left hanging
    gone.cancel()
    endless.cancel()
    chunks = list(waiting)
    with pytest.raises(RequestCancelledError, match="cancelled before it started"):
        list(gone)
    with pytest.raises(RequestCancelledError, match="was cancelled"):
        list(endless)
    scheduler.close()
    assert chunks[-1].result.token_ids == expected.token_ids
    assert scheduler.running == 0 and not scheduler.alive


def test_run_serves_in_the_calling_thread_until_another_closes_it(generator, monkeypatch):
    expected = generator.generate(**vars(REQUESTS[0]))
    scheduler = Scheduler(generator, max_batch_size=2)
    forwards = []
    verify_batch = generator.target.verify_batch
    monkeypatch.setattr(
        generator.target,
        "verify_batch",
        lambda *args: forwards.append(threading.current_thread()) or verify_batch(*args),
    )
    results = []

    def client() -> None:  # its request waits in the queue until run() begins
        results.append(list(scheduler.submit(REQUESTS[0]))[-1].result)
        scheduler.close()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    scheduler.run()  # returns once the client closed it
    thread.join(60)
    assert results[0].token_ids == expected.token_ids
    assert forwards and set(forwards) == {threading.current_thread()}
    assert not scheduler.alive
    with pytest.raises(RuntimeError, match="already serving"):
        scheduler.run()


def test_closing_ends_unfinished_requests_with_a_clear_error(generator):
    scheduler = Scheduler(generator)  # never started: the request is still waiting when it closes
    handle = scheduler.submit(REQUESTS[0])
    scheduler.close()
    with pytest.raises(SchedulerClosedError, match="shut down"):
        list(handle)
    with pytest.raises(SchedulerClosedError, match="shutting down"):
        scheduler.submit(REQUESTS[0])


def test_a_batching_scheduler_measures_the_batch_cost_before_serving():
    loads = []
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[100], seconds=[[0.01, 0.02]])
    builder = AutoBudgetBuilder(BudgetPlanner(curve), batch_cost=lambda: loads.append(1))
    stand_in = SimpleNamespace(engine=SimpleNamespace(builder=builder))
    Scheduler(stand_in, max_batch_size=1)
    assert not loads  # one sequence at a time never shares a forward
    Scheduler(stand_in, max_batch_size=4)
    assert loads == [1]
