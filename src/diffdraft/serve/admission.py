"""What the server refuses before a request costs it much: bodies over a size or too slow to arrive
(checked while reading, before any parsing), prompts with more characters than the context could
hold (checked before tokenizing), completions longer than a cap (:class:`ServerLimits`) and more or
longer stop strings than :data:`~diffdraft.serve.limits.MAX_STOP_STRINGS` and
:data:`~diffdraft.serve.limits.MAX_STOP_CHARS`.

A client once sent a 30 MB body: parsed and tokenized whole, it held the event loop (and so /health
and every other client) for 66 s and grew the server by 2.6 GB before it got its 400.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from diffdraft.serve.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, ServerLimits
from diffdraft.serve.protocol import ApiError


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server takes ({limit} bytes, its --max-request-bytes): "
        "send a shorter prompt, or start the server with a larger --max-request-bytes",
    )


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The request's body, read within ``limits``: a declared or received size over
    ``max_request_bytes`` raises a 413 :class:`ApiError` at once (the rest is never read), a body
    not all there after ``body_timeout`` a 408; a client that leaves raises ``ClientDisconnect``."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()

    async def receive() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:  # a body sent in chunks, with no Content-Length
                raise _too_large(limit)

    try:
        await asyncio.wait_for(receive(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.body_timeout:g} s "
            f"({len(body)} bytes came): send it at once",
        ) from None
    return bytes(body)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry. A
    byte-level entry spells one byte a character, and a character is at least one byte, so no token
    covers more characters of a prompt than its entry has."""
    return max(map(len, tokenizer.get_vocab()))


def check_prompt_chars(chars: int, max_context: int, chars_per_token: int) -> None:
    """Refuse a prompt whose ``chars`` characters could not fit ``max_context`` tokens even if every
    token covered ``chars_per_token`` of them, before paying for tokenizing it (the token count is
    checked after, by the generator, with the same wording). A tokenizer whose normalizer deletes
    characters could fit more; none of the supported families' does."""
    limit = max_context * chars_per_token
    if chars > limit:
        raise ApiError(
            400,
            f"the prompt has {chars} characters but the target's context holds {max_context} tokens, "
            f"at most {limit} characters ({chars_per_token} a token, its tokenizer's longest): "
            "shorten the prompt",
        )


def check_max_tokens(asked: int, cap: int, param: str) -> None:
    """Refuse a request for more than ``cap`` completion tokens (``param``: the field that asked)."""
    if asked > cap:
        raise ApiError(
            400,
            f"{param} is {asked}, more than this server generates for one request "
            f"({cap}, its --max-tokens-cap): ask for at most {cap}",
            param,
        )


def check_stop_strings(stops: list[str]) -> None:
    """Refuse more than :data:`MAX_STOP_STRINGS` stop strings or one longer than :data:`MAX_STOP_CHARS`
    characters (every round searches the output for each, for every request in the batch)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            400,
            f"stop holds {len(stops)} strings; this server takes at most {MAX_STOP_STRINGS}: send fewer",
            "stop",
        )
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(
            400,
            f"a stop string has {longest} characters; this server takes at most {MAX_STOP_CHARS} a string: "
            "send shorter ones",
            "stop",
        )
