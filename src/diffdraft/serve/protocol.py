"""The OpenAI wire format: request and response bodies of ``/v1/chat/completions`` and ``/v1/completions``.

Requests are parsed strictly from the raw JSON (a string where a number belongs is a 400, not a
silent conversion) but, as vLLM does, fields this server does not know are accepted and ignored, so
any OpenAI client works unchanged. Fields it knows but cannot honour without changing what the
client asked for (penalties, ``logit_bias``) are refused with a message naming them.
"""

from __future__ import annotations

import reprlib
import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from diffdraft.runtime.logprobs import MAX_TOP_LOGPROBS

FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "max_new_tokens": "length",
    "context_length": "length",
}
"""diffdraft's stop reasons -> OpenAI's ``finish_reason``."""

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}

GREEDY_BELOW = 1e-5
"""A ``temperature`` below this (0 < t < 1e-5) samples greedily, as vLLM treats it: dividing the
logits by it would overflow float32 (1e-300 made every probability NaN and failed the request), and
at such a temperature sampling is greedy but for logits that tie within about 1e-5."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    """Send one more chunk, with no choices, carrying the request's token counts."""


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    """``developer`` (the newer name OpenAI clients use for ``system``) is rendered as ``system``."""
    content: str | list[TextPart]


class SamplingFields(_Request):
    """What both endpoints share: the model, sampling, stopping and streaming settings."""

    model: str | None = None
    """The served model name; None means the one this server serves (as vLLM allows)."""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    """vLLM's extension; 0 and -1 both disable it."""
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    """Any value torch's generator takes (a larger one would fail inside the engine)."""
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    """Choices: each runs as its own request in the batch; with ``seed``, choice i samples as a
    request with ``seed + i`` would (greedy choices are all the same text)."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end token (benchmarks use it)."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) for a setting this server cannot honour, or None."""
        if self.seed is not None and self.seed + self.n > 2**64:
            return (
                "seed",
                f"seed + n - 1 must stay below 2**64 (choice i samples with seed + i), got {self.seed}",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return (
                    name,
                    f"{name} is not supported (only 0): the output follows the target's own distribution",
                )
        if self.logit_bias:
            return (
                "logit_bias",
                "logit_bias is not supported: the output follows the target's own distribution",
            )
        return None

    def max_new_tokens(self, default: int) -> int:
        return self.max_tokens if self.max_tokens is not None else default

    def max_tokens_field(self) -> str:
        """The name of the field that set :meth:`max_new_tokens` (for error messages)."""
        return "max_tokens"

    def sampling_temperature(self) -> float:
        """The temperature to sample at: OpenAI's default 1 when unset, 0 (greedy) below
        :data:`GREEDY_BELOW`."""
        if self.temperature is None:
            return 1.0
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature

    def prompt_chars(self) -> int:
        """Characters of prompt text, counted before tokenizing it (token ids count none)."""
        raise NotImplementedError

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def choice_seeds(self) -> list[int | None]:
        return [None if self.seed is None else self.seed + i for i in range(self.n)]

    def logprob_count(self) -> int | None:
        """Alternatives per token to return with each token's log-probability; None: no logprobs."""
        raise NotImplementedError


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """The newer name of ``max_tokens``; it wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_new_tokens(default)

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def prompt_chars(self) -> int:
        return sum(len(message["content"]) for message in self.chat_messages())

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: text parts joined, ``developer`` as ``system``."""
        return [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
            }
            for m in self.messages
        ]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """The legacy API's: return each token's log-probability and this many alternatives."""

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if _is_prompt_list(self.prompt) and len(self.prompt) != 1:
            return "prompt", (
                f"give one prompt per request (got a list of {len(self.prompt)}); for several samples "
                "of one prompt, set n"
            )
        if self.echo:
            return "echo", "echo is not supported; leave it unset or false"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported; leave it unset"
        if self.best_of not in (None, 1):
            return "best_of", f"best_of must be 1 (got {self.best_of})"
        return super().unsupported()

    def prompt_input(self) -> dict[str, Any]:
        """``prompt=`` text or ``prompt_token_ids=`` ids, as :class:`GenerationRequest` takes them."""
        prompt = self.prompt[0] if _is_prompt_list(self.prompt) else self.prompt
        if isinstance(prompt, str):
            return {"prompt": prompt}
        return {"prompt_token_ids": prompt}

    def prompt_chars(self) -> int:
        prompt = self.prompt_input().get("prompt")
        return 0 if prompt is None else len(prompt)


def _is_prompt_list(prompt: object) -> bool:
    """A list of prompts (texts or token id lists), as opposed to one prompt's token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def error_body(message: str, type: str, param: str | None = None, code: int | str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
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


def describe_validation_error(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for a request body pydantic rejected: the first bad field, with every way
    it could have been right (a union lists each of its members)."""
    problems: dict[str, list[str]] = {}
    given: dict[str, str] = {}
    for item in error.errors(include_url=False):
        if item["type"] == "json_invalid":
            return f"the request body is not valid JSON: {item['msg'].removeprefix('Invalid JSON: ')}", None
        param = _param(item["loc"])
        problems.setdefault(param, []).append(item["msg"])
        if isinstance(item.get("input"), (str, int, float)):
            given[param] = f" (got {reprlib.repr(item['input'])})"
    param, messages = next(iter(problems.items()))
    if not param:
        return f"the request body must be a JSON object: {messages[0]}", None
    return f"{param}: {', or: '.join(dict.fromkeys(messages))}{given.get(param, '')}", param


def _param(loc: tuple) -> str:
    """A location like ``('messages', 0, 'ChatMessage', 'role')`` as ``messages[0].role``: union
    member tags (type and class names) are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_NAMES:
            path += f".{part}" if path else part
    return path


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class DiffdraftStats(_Response):
    """Non-standard: how the speculative decoding went (clients ignore unknown fields)."""

    method: str
    rounds: int
    tau: float
    """Mean tokens committed per target forward, bonus token included."""
    acceptance_lengths: list[int]
    stop_reason: str


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]
    """The token's text as UTF-8 (a token that is part of a character decodes to U+FFFD)."""


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(_Response):
    """The legacy completions format: parallel lists over the tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]
    """Where each token's text starts in the completion's text."""


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    diffdraft: DiffdraftStats
    """Non-standard: this choice's own decoding (the response's top-level one is choice 0's)."""


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    diffdraft: DiffdraftStats


class Delta(_Response):
    """Only what this chunk adds: unset fields are left out (the last chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    diffdraft: DiffdraftStats | None = None
    """On the chunk that carries the finish reason only."""


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    diffdraft: DiffdraftStats | None = None
    """Non-standard, in a whole response only: this choice's own decoding (as :class:`ChatChoice`)."""


class Completion(_Response):
    """Also each streamed chunk of ``/v1/completions`` (OpenAI sends the same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    diffdraft: DiffdraftStats | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffdraft"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
