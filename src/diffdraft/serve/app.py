"""The OpenAI-compatible HTTP API over a :class:`~diffdraft.serve.scheduler.Scheduler`.

Every request is checked before it takes a place in the batch; anything wrong with it comes back as
OpenAI's error body with a 4xx status, never a traceback, and other requests go on. A client that
disconnects (streaming or not) has its request cancelled, so its batch slot frees for the next one.
The app does not own the scheduler: whoever started it closes it. It can answer before there is one:
``diffdraft serve`` opens its port at once and loads the model meanwhile, so /health says "loading"
(503) and every other route asks the client to retry, until :meth:`Readiness.ready` hands it the
started scheduler. With an API key, every ``/v1``
route asks for it as ``Authorization: Bearer KEY`` (as OpenAI and vLLM do); /health and /metrics
stay open for probes and scrapers.

The event loop only reads, checks and answers: a body is read within :class:`ServerLimits` before it
is parsed, and prompts are tokenized on a worker thread of the app's own, so a huge prompt never
holds up /health or another client's stream. One thread, because a fast tokenizer used from two
threads at once can fail ("Already borrowed"); the tokenizer releases the interpreter's lock
while it works, so the loop runs meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from diffdraft.errors import DiffdraftError, InvalidRequestError
from diffdraft.generator import GenerationChunk, GenerationRequest, GenerationResult, PreparedRequest
from diffdraft.serve.admission import (
    check_max_tokens,
    check_prompt_chars,
    check_stop_strings,
    longest_token_chars,
    read_body,
)
from diffdraft.serve.endpoints import ChatEndpoint, CompletionEndpoint, Endpoint, usage_of
from diffdraft.serve.limits import ServerLimits
from diffdraft.serve.metrics import CLIENT_CLOSED, CONTENT_TYPE, ServerMetrics
from diffdraft.serve.protocol import (
    ApiError,
    ModelCard,
    ModelList,
    SamplingFields,
    describe_validation_error,
    now,
)
from diffdraft.serve.scheduler import QueueFullError, RequestHandle, Scheduler, SchedulerClosedError


def api_error(error: BaseException) -> ApiError:
    """The HTTP status and message for an error a request ran into."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidRequestError):
        return ApiError(400, str(error))
    if isinstance(error, QueueFullError):
        return ApiError(429, f"the server is busy: {error}")
    if isinstance(error, SchedulerClosedError):
        return ApiError(503, str(error))
    if isinstance(error, DiffdraftError):
        return ApiError(400, str(error))
    return ApiError(500, f"the server failed on this request ({type(error).__name__}: {error}); retry it")


class ClientGone(Exception):
    """The client closed the connection before its request finished."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _chunks(
    handles: list[RequestHandle], request: Request
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(choice index, chunk) as each choice's chunks come, until every choice has its last; raises
    :class:`ClientGone` if the client leaves first, and a choice's error as soon as it comes. However
    it ends, every choice is cancelled, so an abandoned request frees its batch slots."""
    gone = asyncio.ensure_future(_disconnected(request))
    streams = [aiter(handle) for handle in handles]
    waiting = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while waiting:
            await asyncio.wait({*waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            ready = sorted((i, step) for step, i in waiting.items() if step.done())
            if not ready:
                raise ClientGone
            for i, step in ready:
                del waiting[step]
                chunk = step.result()
                yield i, chunk
                if chunk.result is None:
                    waiting[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in (gone, *waiting):
            if not task.done():
                task.cancel()
        for handle in handles:
            handle.cancel()


class _Api:
    def __init__(self, scheduler: Scheduler, model_name: str, limits: ServerLimits) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.limits = limits
        self.method = scheduler.generator.method
        tokenizer = scheduler.generator.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        """A token's text, for log-probabilities (special tokens shown as they are)."""
        self.max_context = scheduler.generator.target.max_context
        self.chars_per_token = longest_token_chars(tokenizer)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffdraft-tokenize")
        """Where prompts are tokenized, off the event loop (see the module docstring)."""
        self.metrics = ServerMetrics(scheduler)
        self.started = now()

    async def complete(self, request: Request, kind: type[Endpoint]) -> Response:
        arrival = time.perf_counter()
        endpoint = kind(self.model_name, self.method, self.token_text)
        try:
            body = self._parse(await read_body(request, self.limits), kind)
            self._check_choices(body.n)  # before building them: n can be any size
            check_stop_strings(body.stop_strings())
            generations = endpoint.generation_requests(body, self._max_new_tokens(body))
            check_prompt_chars(body.prompt_chars(), self.max_context, self.chars_per_token)
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self.tokenizing, self._prepare, generations)
            handles = self._submit(prepared)
        except ClientDisconnect:  # gone while sending its body
            self.metrics.count(kind.path, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as error:  # every way a request can be refused: an OpenAI error body
            failure = api_error(error)
            self.metrics.count(kind.path, failure.status)
            return failure.response()
        if body.stream:
            events = self._stream(endpoint, handles, request, arrival, body.include_usage())
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return await self._collect(endpoint, handles, request, arrival)

    def _max_new_tokens(self, body: SamplingFields) -> int:
        """The completion tokens a request may generate: what it asks for, refused above
        ``--max-tokens-cap``; without a limit of its own, the cap or the context, the smaller."""
        cap = self.limits.max_tokens_cap
        asked = body.max_new_tokens(min(cap, self.max_context))
        check_max_tokens(asked, cap, body.max_tokens_field())
        return asked

    def _check_choices(self, choices: int) -> None:
        if choices > max(1, self.scheduler.max_queue):
            raise ApiError(
                400,
                f"n is at most {self.scheduler.max_queue} on this server (the length of its queue, "
                f"--max-queue), got {choices}",
                "n",
            )

    def _prepare(self, requests: list[GenerationRequest]) -> list[PreparedRequest]:
        """Every choice encoded (on the tokenizing thread): the prompt once, the other choices
        reuse its token ids."""
        generator = self.scheduler.generator
        first = generator.prepare(requests[0])
        ids = first.spec.prompt_ids
        same_prompt = {"prompt": None, "messages": None, "prompt_token_ids": ids}
        return [first, *(generator.prepare(dataclasses.replace(r, **same_prompt)) for r in requests[1:])]

    def _submit(self, requests: list[PreparedRequest]) -> list[RequestHandle]:
        """Every choice's request, or none: a choice refused (e.g. the queue is full) cancels those
        already queued."""
        handles: list[RequestHandle] = []
        try:
            for generation in requests:
                handles.append(self.scheduler.submit(generation))
        except Exception:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def _parse(self, raw: bytes, kind: type[Endpoint]) -> SamplingFields:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ApiError(
                400,
                f"the request body is not valid UTF-8 (byte {raw[error.start]:#04x} at offset "
                f"{error.start}): send the JSON encoded as UTF-8",
            ) from None
        try:
            body = kind.body_model.model_validate_json(raw)
        except ValidationError as error:
            raise ApiError(400, *describe_validation_error(error)) from None
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                404,
                f"The model `{body.model}` does not exist: this server serves `{self.model_name}` "
                "(GET /v1/models lists it)",
                "model",
            )
        unsupported = body.unsupported()
        if unsupported is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        return body

    async def _collect(
        self, endpoint: Endpoint, handles: list[RequestHandle], request: Request, arrival: float
    ) -> Response:
        first_text = None
        results: list[GenerationResult | None] = [None] * len(handles)
        try:
            async for i, chunk in _chunks(handles, request):
                if first_text is None and chunk.text:
                    first_text = time.perf_counter()
                    self.metrics.time_to_first_token.observe(first_text - arrival)
                results[i] = chunk.result
        except ClientGone:
            self.metrics.count(endpoint.path, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        except Exception as error:
            failure = api_error(error)
            self.metrics.count(endpoint.path, failure.status)
            return failure.response()
        prompt_tokens = handles[0].prompt_tokens
        self._finished(endpoint.path, prompt_tokens, results, arrival)
        return JSONResponse(endpoint.response(results, prompt_tokens))

    async def _stream(
        self,
        endpoint: Endpoint,
        handles: list[RequestHandle],
        request: Request,
        arrival: float,
        usage: bool,
    ) -> AsyncIterator[str]:
        status = CLIENT_CLOSED
        sent = [False] * len(handles)
        results: list[GenerationResult | None] = [None] * len(handles)
        try:
            async for i, chunk in _chunks(handles, request):
                if chunk.text and not any(sent):
                    self.metrics.time_to_first_token.observe(time.perf_counter() - arrival)
                for event in endpoint.chunks(i, chunk.text, not sent[i], chunk.logprobs):
                    sent[i] = True
                    yield _sse(event)
                if chunk.result is not None:
                    for event in endpoint.chunks(i, "", first=not sent[i]):
                        yield _sse(event)
                    yield _sse(endpoint.last_chunk(i, chunk.result))
                    results[i] = chunk.result
            prompt_tokens = handles[0].prompt_tokens
            if usage:
                yield _sse(endpoint.usage_chunk(usage_of(results, prompt_tokens)))
            self._finished(endpoint.path, prompt_tokens, results, arrival, count=False)
            status = 200
        except ClientGone:
            return
        except Exception as error:  # the request failed mid-stream: tell the client in the stream
            failure = api_error(error)
            status = failure.status
            yield _sse(failure.body())
        finally:  # also when the server cancels this generator because the client left
            for handle in handles:
                handle.cancel()
            self.metrics.count(endpoint.path, status)
        yield "data: [DONE]\n\n"

    def _finished(
        self,
        path: str,
        prompt_tokens: int,
        results: list[GenerationResult],
        arrival: float,
        count: bool = True,
    ) -> None:
        """Metrics of a finished request: each choice is a generation of its own (its own prefill)."""
        if count:
            self.metrics.count(path, 200)
        self.metrics.latency.observe(time.perf_counter() - arrival)
        for result in results:
            self.metrics.finished(prompt_tokens, len(result.token_ids), result.stats)

    def models(self) -> dict:
        card = ModelCard(id=self.model_name, created=self.started, max_model_len=self.max_context)
        return ModelList(data=[card]).model_dump()


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Readiness:
    """Whether the app has a model to serve yet: the :class:`_Api` over the scheduler once
    :meth:`ready` gave one, else what the server is doing meanwhile (shown on /health)."""

    def __init__(self, model_name: str, limits: ServerLimits) -> None:
        self.model_name = model_name
        self.limits = limits
        self.stage = "loading the model"
        self._api: _Api | None = None

    def ready(self, scheduler: Scheduler) -> None:
        """Serve through ``scheduler`` (started or about to run its rounds) from now on."""
        self._api = _Api(scheduler, self.model_name, self.limits)

    @property
    def loaded(self) -> bool:
        return self._api is not None

    @property
    def api(self) -> _Api:
        """The API, or a 503 that tells the client to retry while the model loads."""
        if self._api is None:
            raise ApiError(503, f"the server is still starting ({self.stage}); retry in a few seconds")
        return self._api

    def close(self) -> None:
        if self._api is not None:
            self._api.tokenizing.shutdown(wait=True, cancel_futures=True)


def create_app(
    scheduler: Scheduler | None,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    docs: bool = False,
) -> FastAPI:
    """The ASGI app serving ``model_name`` through a started ``scheduler`` (None: one that
    ``app.state.readiness.ready`` gives later; until then /health answers 503 "loading");
    ``api_key`` guards /v1, ``limits`` bound each request (None: the defaults), ``docs`` serves
    /docs, /redoc and /openapi.json (off by default: a public server need not describe itself to
    strangers)."""
    readiness = Readiness(model_name, limits or ServerLimits())
    if scheduler is not None:
        readiness.ready(scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        readiness.close()

    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(
        title="diffdraft",
        summary="OpenAI-compatible lossless speculative decoding",
        lifespan=lifespan,
        **pages,
    )
    app.state.readiness = readiness

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next) -> Response:
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1") and not hmac.compare_digest(given, expected):
                message = (
                    "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'"
                )
                return ApiError(401, message).response()
            return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        if error.status_code == 404:
            message += "; the endpoints are /v1/chat/completions, /v1/completions and /v1/models"
        return ApiError(error.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return ApiError(400, f"invalid request: {error.errors()}").response()

    @app.exception_handler(ApiError)
    async def refused(request: Request, error: ApiError) -> JSONResponse:
        # its own handler: the one for Exception answers from Starlette's outermost middleware, which
        # then raises the error again for the server to log, and every poll of /v1/models while the
        # model loaded wrote a traceback headed "Exception in ASGI application"
        return error.response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()

    @app.post(ChatEndpoint.path)
    async def chat_completions(request: Request) -> Response:
        return await readiness.api.complete(request, ChatEndpoint)

    @app.post(CompletionEndpoint.path)
    async def completions(request: Request) -> Response:
        return await readiness.api.complete(request, CompletionEndpoint)

    @app.get("/v1/models")
    async def models() -> dict:
        return readiness.api.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not readiness.loaded:
            body = {"status": "loading", "model": model_name, "stage": readiness.stage}
            return JSONResponse(body, status_code=503)
        scheduler = readiness.api.scheduler
        alive = scheduler.alive
        body = {"status": "ok" if alive else "unavailable", "model": model_name}
        body.update(queue_depth=scheduler.queue_depth, running=scheduler.running)
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(readiness.api.metrics.render(), media_type=CONTENT_TYPE)

    return app
