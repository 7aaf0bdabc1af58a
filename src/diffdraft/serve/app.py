"""The OpenAI-compatible HTTP API over a :class:`~diffdraft.serve.scheduler.Scheduler`.

Every request is checked before it takes a place in the batch; anything wrong with it comes back as
OpenAI's error body with a 4xx status, never a traceback, and other requests go on. A client that
disconnects (streaming or not) has its request cancelled, so its batch slot frees for the next one.
The app does not own the scheduler: whoever started it closes it. With an API key, every ``/v1``
route asks for it as ``Authorization: Bearer KEY`` (as OpenAI and vLLM do); /health and /metrics
stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from diffdraft.errors import DiffdraftError, InvalidRequestError
from diffdraft.generator import GenerationChunk, GenerationRequest, GenerationResult
from diffdraft.serve.endpoints import ChatEndpoint, CompletionEndpoint, Endpoint, usage_of
from diffdraft.serve.metrics import CLIENT_CLOSED, CONTENT_TYPE, ServerMetrics
from diffdraft.serve.protocol import (
    ModelCard,
    ModelList,
    SamplingFields,
    describe_validation_error,
    error_body,
    now,
)
from diffdraft.serve.scheduler import QueueFullError, RequestHandle, Scheduler, SchedulerClosedError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request that gets an OpenAI error body instead of a completion."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, ERROR_TYPES.get(self.status, "api_error"), self.param, self.status)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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
    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.method = scheduler.generator.method
        tokenizer = scheduler.generator.tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        """A token's text, for log-probabilities (special tokens shown as they are)."""
        self.max_context = scheduler.generator.target.max_context
        self.metrics = ServerMetrics(scheduler)
        self.started = now()

    async def complete(self, request: Request, kind: type[Endpoint]) -> Response:
        arrival = time.perf_counter()
        endpoint = kind(self.model_name, self.method, self.token_text)
        try:
            body = self._parse(await request.body(), kind)
            handles = self._submit(endpoint.generation_requests(body, self.max_context))
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

    def _submit(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Every choice's request, or none: a choice refused (e.g. the queue is full) cancels those
        already queued."""
        if len(requests) > max(1, self.scheduler.max_queue):
            raise ApiError(
                400,
                f"n is at most {self.scheduler.max_queue} on this server (the length of its queue, "
                f"--max-queue), got {len(requests)}",
                "n",
            )
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


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``model_name`` through a started ``scheduler``; ``api_key`` guards /v1."""
    api = _Api(scheduler, model_name)
    app = FastAPI(title="diffdraft", summary="OpenAI-compatible lossless speculative decoding")
    app.state.api = api

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

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        return api_error(error).response()

    @app.post(ChatEndpoint.path)
    async def chat_completions(request: Request) -> Response:
        return await api.complete(request, ChatEndpoint)

    @app.post(CompletionEndpoint.path)
    async def completions(request: Request) -> Response:
        return await api.complete(request, CompletionEndpoint)

    @app.get("/v1/models")
    async def models() -> dict:
        return api.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = scheduler.alive
        body = {"status": "ok" if alive else "unavailable", "model": model_name}
        body.update(queue_depth=scheduler.queue_depth, running=scheduler.running)
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE)

    return app
