"""Requests a hostile or careless client sends get a quick OpenAI error body (or a bounded answer),
and never hold up /health or the other clients: the body limit, the slow-body timeout, the prompt
check before tokenizing, tokenizing off the event loop, the max_tokens cap, the stop strings, the
sampling bounds, invalid UTF-8, the API docs left off and connections that send no whole request."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import diffdraft
from diffdraft.serve.app import create_app
from diffdraft.serve.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, ServerLimits
from diffdraft.serve.scheduler import Scheduler

from diffdraft_testing.serving import LiveServer, make_chat_checkpoint, serving

MODEL = "tiny"
LIMITS = ServerLimits(max_request_bytes=4096, max_tokens_cap=40, body_timeout=1.0, header_timeout=1.0)
GREEDY = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return diffdraft.load(checkpoint, method="pld")


@pytest.fixture(scope="module")
def server(checkpoint):
    with serving(diffdraft.load(checkpoint, method="pld"), MODEL, limits=LIMITS, max_batch_size=4) as live:
        yield live


def post(server, body: bytes | dict, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json", **headers}
    )


def raw_exchange(server, head: str, body: bytes = b"") -> tuple[int, dict, float]:
    """(status, error body, seconds to the answer) of a request written by hand on a socket."""
    begin = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2]), time.monotonic() - begin


def head(length: int | None) -> str:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{size}\r\n"


def test_a_body_over_the_limit_gets_413_without_being_read(server):
    status, error, seconds = raw_exchange(server, head(10 * 2**30), b'{"prompt": "hi"}')  # it lies
    assert status == 413 and seconds < 5
    assert "4096 bytes, its --max-request-bytes" in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == 413
    too_big = post(server, {**GREEDY, "prompt": "x" * 5000})
    assert too_big.status_code == 413


def test_a_chunked_body_is_cut_off_at_the_limit(server):
    chunk = b"x" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    status, error, _ = raw_exchange(server, head(None), chunks)
    assert status == 413 and "--max-request-bytes" in error["error"]["message"]


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head(100).encode() + b'{"prompt": ')  # and nothing more
        begin = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
    assert time.monotonic() - begin < 5


def test_invalid_utf8_is_a_400_that_says_so(server):
    response = post(server, b'{"prompt": "caf\xe9", "max_tokens": 2}')
    assert response.status_code == 400
    assert "not valid UTF-8 (byte 0xe9 at offset 15)" in response.json()["error"]["message"]


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(server, monkeypatch):
    tokenized = []
    prepare = server.scheduler.generator.prepare
    monkeypatch.setattr(server.scheduler.generator, "prepare", lambda r: tokenized.append(r) or prepare(r))
    chars_per_token = max(map(len, server.scheduler.generator.tokenizer.get_vocab()))
    prompt = "a" * (128 * chars_per_token + 1)  # context 128
    response = post(server, {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and tokenized == []
    message = response.json()["error"]["message"]
    assert f"the prompt has {len(prompt)} characters but the target's context holds 128 tokens" in message
    chat = post(server, {"messages": [{"role": "user", "content": prompt}]}, "/v1/chat/completions")
    assert chat.status_code == 400 and "characters" in chat.json()["error"]["message"] and tokenized == []
    fits_in_chars = post(server, {"prompt": "a " * 300, "max_tokens": 2})  # counted in tokens after
    assert fits_in_chars.status_code == 400
    assert "tokens but the target's context holds 128" in fits_in_chars.json()["error"]["message"]
    assert len(tokenized) == 1


def test_health_answers_while_a_prompt_is_tokenized(server, monkeypatch):
    tokenizing, release = threading.Event(), threading.Event()
    prepare = server.scheduler.generator.prepare

    def slow_prepare(request):
        tokenizing.set()
        assert release.wait(10)
        return prepare(request)

    monkeypatch.setattr(server.scheduler.generator, "prepare", slow_prepare)
    result = {}
    client = threading.Thread(target=lambda: result.update(reply=post(server, GREEDY)))
    client.start()
    try:
        assert tokenizing.wait(10)
        health = httpx.get(server.url + "/health", timeout=2)
        assert health.status_code == 200
    finally:
        release.set()
        client.join(30)
    assert result["reply"].status_code == 200


def test_max_tokens_over_the_cap_is_a_400_and_no_max_tokens_gets_the_cap(server):
    over = post(server, {**GREEDY, "max_tokens": 41})
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["param"] == "max_tokens" and "ask for at most 40" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 41}
    newer = post(server, chat, "/v1/chat/completions")
    assert newer.status_code == 400 and newer.json()["error"]["param"] == "max_completion_tokens"
    unlimited = post(server, {"prompt": "hello world", "temperature": 0, "ignore_eos": True})
    assert unlimited.status_code == 200 and unlimited.json()["usage"]["completion_tokens"] == 40


def test_a_tiny_temperature_is_greedy_and_non_finite_sampling_settings_are_400(server, reference):
    expected = reference.generate("hello world", max_new_tokens=6, ignore_eos=True).text
    tiny = post(server, {**GREEDY, "temperature": 1e-300})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == expected
    for field, value in [("temperature", b"1e999"), ("temperature", b"NaN"), ("top_p", b"NaN")]:
        response = post(server, b'{"prompt": "hi", "%s": %s}' % (field.encode(), value))
        assert response.status_code == 400, (field, value)
        assert response.json()["error"]["param"] == field


def test_the_api_docs_are_off_unless_asked_for(server, checkpoint):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404
    scheduler = Scheduler(diffdraft.load(checkpoint, method="ar"))
    with LiveServer(create_app(scheduler, MODEL, docs=True)) as live:
        assert httpx.get(live.url + "/docs").status_code == 200
        assert "/v1/completions" in httpx.get(live.url + "/openapi.json").json()["paths"]


def test_a_huge_n_is_refused_before_its_choices_are_built(server):
    start = time.monotonic()
    response = post(server, {**GREEDY, "n": 10**12})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert time.monotonic() - start < 5


def test_too_many_or_too_long_stop_strings_are_a_400_naming_the_limit(server):
    """Every round searches the output for each stop string, in the thread all requests' rounds run
    in: a body of thousands of them would stall every client."""
    many = post(server, {**GREEDY, "stop": [f"stop{i}" for i in range(MAX_STOP_STRINGS + 1)]})
    assert many.status_code == 400 and many.json()["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS}" in many.json()["error"]["message"]
    long = post(server, {**GREEDY, "stop": "x" * (MAX_STOP_CHARS + 1)})
    assert long.status_code == 400 and f"at most {MAX_STOP_CHARS}" in long.json()["error"]["message"]
    at_limits = ["x" * MAX_STOP_CHARS, *(f"stop{i}" for i in range(MAX_STOP_STRINGS - 1))]
    assert post(server, {**GREEDY, "stop": at_limits}).status_code == 200


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (sending ``trickle`` every 0.2 s meanwhile), or None
    if it still held it after ``seconds``."""
    begin = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - begin < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - begin
        except TimeoutError:
            if trickle:
                sock.sendall(trickle)
        except ConnectionResetError:
            return time.monotonic() - begin
    return None


def test_a_connection_that_sends_no_whole_request_is_closed_at_the_header_deadline(server):
    """Held connections would use up the server's file descriptors: one that sends nothing, and one
    that sends its headers a line at a time, are both closed about header_timeout (1 s) after they
    opened; a keep-alive connection idle after its response is closed too."""
    with socket.create_connection(("127.0.0.1", server.port)) as silent:
        assert (_closed_within(silent, 5) or 99) < 3
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert (_closed_within(slow, 5, trickle=b"X-Slow: 1\r\n") or 99) < 3


def test_a_request_under_way_outlives_the_header_deadline(server, reference, monkeypatch):
    """A request whose answer takes well past header_timeout (here its prompt takes 2.5 s to prepare)
    is never cut: the deadline counts only time without a request under way."""
    prepare = server.scheduler.generator.prepare

    def slow_prepare(request):
        time.sleep(2.5)
        return prepare(request)

    monkeypatch.setattr(server.scheduler.generator, "prepare", slow_prepare)
    reply = post(server, GREEDY)
    assert reply.status_code == 200
    expected = reference.generate("hello world", max_new_tokens=6, ignore_eos=True).text
    assert reply.json()["choices"][0]["text"] == expected
