"""Requests from many clients onto one :class:`~diffdraft.decoding.batching.BatchEngine`.

One thread owns the models: between rounds it admits waiting requests into the batch (up to
``max_batch_size``), drops cancelled ones, runs one round for all, and hands each request the text
its tokens made visible. Clients submit from any thread; an ``async`` caller (the HTTP server)
gets its chunks through its event loop, a plain caller by blocking iteration.

A request that fails on its own (its prefill, its part of a round, the decoding of its text) ends
with that error alone: the others in the batch and the rounds go on. Only a failure of what the
batch shares, such as the target's forward running out of memory, ends every request in it.

That thread should be the one that loaded the models (:meth:`Scheduler.run`), not a new one
(:meth:`Scheduler.start`): PyTorch's CPU builds run their parallel kernels on OpenMP, whose GNU
runtime keeps a pool of threads per thread that ever ran a parallel kernel. Once the pools' threads
outnumber the cores, they sleep between kernels instead of spinning, and a decoding round waits
hundreds of times for them to wake: on a 2-core CPU a worker thread started after the load
decoded far slower than the loading thread (docs/decisions.md, "generate in the loading thread").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator

from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.decoding.batching import BatchEngine
from diffdraft.decoding.engine import SequenceRun
from diffdraft.errors import DiffdraftError
from diffdraft.generator import GenerationChunk, GenerationRequest, PreparedRequest, SpeculativeGenerator

log = logging.getLogger(__name__)


class QueueFullError(DiffdraftError):
    """Too many requests are waiting: the client should retry later."""


class SchedulerClosedError(DiffdraftError):
    """The scheduler stopped before the request finished."""


class RequestCancelledError(DiffdraftError):
    """Ends the output of a request that was cancelled before it finished."""


class RequestHandle:
    """One submitted request's output: iterate its :class:`GenerationChunk` s (the last carries the
    result), with ``for`` from a thread or ``async for`` from the event loop it was submitted on;
    :meth:`cancel` frees its place in the batch (a client that went away)."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.cancelled = threading.Event()
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._async_chunks: asyncio.Queue = asyncio.Queue()
        except RuntimeError:
            self._loop = None
            self._chunks: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.spec.prompt_ids)

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, item: GenerationChunk | BaseException) -> None:
        """Called by the worker: a chunk, or the error that ended the request."""
        if self._loop is None:
            self._chunks.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_chunks.put_nowait, item)
        except RuntimeError:  # the client's event loop is gone; nobody is listening
            self.cancel()

    def __iter__(self) -> Iterator[GenerationChunk]:
        if self._loop is not None:
            raise TypeError("this request was submitted from an event loop: use `async for`")
        while True:
            item = self._chunks.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.result is not None:
                return

    async def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        if self._loop is None:
            raise TypeError("this request was submitted outside an event loop: use `for`")
        while True:
            item = await self._async_chunks.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.result is not None:
                return


def times_shared_forwards(generator: SpeculativeGenerator, max_batch_size: int) -> bool:
    """Whether a :class:`Scheduler` over ``generator`` measures (or reads from the cache) what forwards
    shared by several sequences cost before it serves: budget 'auto' plans shared rounds from that
    curve, and only batches of more than one sequence share them."""
    return max_batch_size > 1 and isinstance(generator.engine.builder, AutoBudgetBuilder)


class Scheduler:
    """Continuous batching of submitted requests over ``generator``'s target, drafter and tree rule."""

    def __init__(self, generator: SpeculativeGenerator, max_batch_size: int = 8, max_queue: int = 64) -> None:
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(
                f"need max_batch_size >= 1 and max_queue >= 0, got {max_batch_size}, {max_queue}"
            )
        self.generator = generator
        if times_shared_forwards(generator, max_batch_size):
            generator.engine.builder.rounds.prepare_batches()
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._batch = BatchEngine(generator.engine)
        self._waiting: deque[RequestHandle] = deque()
        self._running: dict[SequenceRun, RequestHandle] = {}
        self._wake = threading.Condition()
        self._closing = False
        self._serving: threading.Thread | None = None
        """The thread that runs the rounds, once :meth:`run` or :meth:`start` claimed them."""
        self._started: threading.Thread | None = None
        """The thread :meth:`start` made (:meth:`close` joins it)."""
        self._stopped = threading.Event()
        """Set once the rounds have stopped."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a place in the batch."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """Whether it is serving (running rounds and not closed)."""
        return self._serving is not None and not self._stopped.is_set() and not self._closing

    def run(self) -> None:
        """Run the rounds in the calling thread until :meth:`close` (called from another thread):
        the thread that loaded the models serves fastest (see the module docstring)."""
        self._claim(threading.current_thread())
        self._work()

    def start(self) -> Scheduler:
        """Run the rounds in a new thread (for callers that must keep theirs, such as tests; slower on
        a CPU than :meth:`run`, see the module docstring)."""
        if self._serving is None:
            thread = threading.Thread(target=self._work, name="diffdraft-scheduler", daemon=True)
            self._claim(thread)
            self._started = thread
            thread.start()
        return self

    def _claim(self, thread: threading.Thread) -> None:
        with self._wake:
            if self._serving is not None:
                raise RuntimeError("this scheduler is already serving")
            self._serving = thread

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop after the current round (waiting up to ``timeout`` seconds for it when another thread
        runs the rounds); unfinished requests end with :class:`SchedulerClosedError`."""
        with self._wake:
            self._closing = True
            self._wake.notify()
            serving = self._serving
        if serving is None:
            self._end_unfinished()
        elif serving is self._started:
            serving.join(timeout)
        elif serving is not threading.current_thread():
            self._stopped.wait(timeout)  # run()'s caller goes on after it: nothing to join

    def submit(self, request: GenerationRequest | PreparedRequest) -> RequestHandle:
        """Queue a request; its errors (bad settings, a prompt over the context) raise here, at once.
        A :class:`PreparedRequest` (from ``generator.prepare``) is queued as it is: a caller that must
        not wait for the tokenizer, such as an event loop, prepares it on another thread."""
        prepared = request if isinstance(request, PreparedRequest) else self.generator.prepare(request)
        handle = RequestHandle(prepared)
        with self._wake:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down: retry on another instance")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (the queue holds {self.max_queue}): "
                    "retry later"
                )
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def _work(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._closing and not self._waiting and not self._running:
                        self._wake.wait()
                    if self._closing:
                        break
                    admitted = []
                    while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
                        admitted.append(self._waiting.popleft())
                for handle in admitted:
                    self._admit(handle)
                self._drop_cancelled()
                try:
                    committed = self._batch.step(on_failure=self._fail)
                except Exception as error:  # a shared part, e.g. out of memory: fail this batch, keep serving
                    log.exception("a round failed: its %d requests end with the error", len(self._running))
                    self._fail_running(error)
                    continue
                for sequence, new in committed:
                    self._deliver(sequence, new)
        finally:
            self._end_unfinished()
            self._stopped.set()

    def _end_unfinished(self) -> None:
        closed = SchedulerClosedError("the server shut down before this request finished")
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
        for handle in [*waiting, *self._running.values()]:
            handle.put(closed)
        self._running.clear()

    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled.is_set():
            handle.put(RequestCancelledError("the request was cancelled before it started"))
            return
        prepared = handle.prepared
        try:
            sequence, first = self._batch.add(prepared.spec)
        except Exception as error:
            log.exception("a request failed in its prefill")
            handle.put(error)
            return
        self._running[sequence] = handle
        self._deliver(sequence, first)

    def _deliver(self, sequence: SequenceRun, new: list[int]) -> None:
        handle = self._running[sequence]
        try:
            chunk = handle.prepared.add(new)
            last = self.generator.finish(handle.prepared) if sequence.done else None
        except Exception as error:  # e.g. decoding its text
            self._fail(sequence, error)
            return
        if chunk is not None:
            handle.put(chunk)
        if last is not None:
            del self._running[sequence]
            handle.put(last)

    def _fail(self, sequence: SequenceRun, error: Exception) -> None:
        """One request failed on its own: it leaves the batch and ends with ``error``; the rest go on."""
        log.error("a request failed on its own; the batch goes on", exc_info=error)
        self._batch.remove(sequence)
        self._running.pop(sequence).put(error)

    def _drop_cancelled(self) -> None:
        for sequence, handle in list(self._running.items()):
            if handle.cancelled.is_set():
                self._batch.remove(sequence)
                del self._running[sequence]
                handle.put(RequestCancelledError("the request was cancelled"))

    def _fail_running(self, error: Exception) -> None:
        for sequence, handle in list(self._running.items()):
            self._batch.remove(sequence)
            handle.put(error)
        self._running.clear()
