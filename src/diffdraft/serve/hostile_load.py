"""A bounded mix of hostile and normal clients against a running server on this machine.

Normal clients send one short greedy completion in a loop (streamed and not, in turn) and check each
answer against the text the request gets alone. Beside them, one client of each hostile kind loops:
bodies far over the size limit, a Content-Length that lies, malformed JSON, invalid UTF-8, a
``max_tokens`` over the cap, a tiny positive temperature, a body sent a byte at a time (slowloris)
and a stream read a few bytes at a time. A prober times /health throughout. Every loop stops at the
deadline or after a bounded count; the slow clients give up at the deadline.

The report says, per kind, how its requests ended (HTTP status, or how the connection ended), and
for the normal clients their latency and whether every answer was complete and correct.
``benchmarks/serve-hostile-clients`` runs it for a minute against ``diffdraft serve``; a test runs a
few seconds of it. Standard library only, raw sockets where a client must misbehave.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from diffdraft.serve.load import check_url, percentile

MAX_REQUESTS_PER_CLIENT = 10_000
"""A bound on every client's loop besides its deadline."""
HOSTILE_KINDS = (
    "huge body",
    "lying length",
    "malformed JSON",
    "invalid UTF-8",
    "over-cap max_tokens",
    "tiny temperature",
    "slow sender",
    "slow reader",
)


@dataclass
class MixSettings:
    url: str
    normal_body: dict
    """The normal clients' /v1/completions request: greedy (temperature 0), so every answer is the same."""
    expected_text: str
    """``normal_body``'s text when the server answers it alone."""
    duration: float = 60.0
    normal_clients: int = 4
    hostile: bool = True
    """False: the normal clients alone (the baseline)."""
    max_tokens_cap: int = 4096
    """The server's --max-tokens-cap: the over-cap client asks for one more."""
    huge_bytes: int = 30 * 2**20
    """The huge bodies' size (a 30 MB request once held a server's event loop for 66 s)."""
    slow_send_seconds: float = 1.0
    """Between the slow sender's bytes."""
    slow_read_seconds: float = 1.0
    """Between the slow reader's reads of 64 bytes."""
    timeout: float = 120.0
    """Per request; a normal request that takes longer counts as failed."""

    def __post_init__(self) -> None:
        check_url(self.url, allow_remote=False)


@dataclass
class MixReport:
    seconds: float
    normal_latencies: list[float] = field(default_factory=list)
    normal_correct: int = 0
    normal_wrong: list[str] = field(default_factory=list)
    """How each normal request that did not get the expected text ended (its status, text or error)."""
    health_latencies: list[float] = field(default_factory=list)
    health_failures: int = 0
    outcomes: dict[str, Counter] = field(default_factory=dict)
    """Per hostile kind: how its requests ended, and how many times."""
    answer_seconds: dict[str, float] = field(default_factory=dict)
    """Per hostile kind: the longest it waited for its answer."""

    def summary(self) -> dict:
        def ms(values: list[float], p: float) -> float | None:
            value = percentile(values, p)
            return None if value is None else round(value * 1000, 1)

        normal = self.normal_latencies
        return {
            "seconds": round(self.seconds, 1),
            "normal": {
                "requests": len(normal) + len(self.normal_wrong),
                "correct": self.normal_correct,
                "wrong_or_failed": self.normal_wrong[:10],
                "latency_ms": {"p50": ms(normal, 50), "p95": ms(normal, 95), "max": ms(normal, 100)},
                "requests_per_s": round(len(normal) / self.seconds, 2),
            },
            "health": {
                "probes": len(self.health_latencies),
                "failures": self.health_failures,
                "latency_ms": {"p50": ms(self.health_latencies, 50), "max": ms(self.health_latencies, 100)},
            },
            "hostile": {
                kind: {"outcomes": dict(counts), "slowest_answer_s": round(self.answer_seconds[kind], 2)}
                for kind, counts in self.outcomes.items()
            },
        }


def run_mix(settings: MixSettings) -> MixReport:
    """Run every client until ``settings.duration`` has passed; returns when all have stopped."""
    begin = time.monotonic()
    deadline = begin + settings.duration
    report = MixReport(seconds=settings.duration)
    lock = threading.Lock()
    target = _Target(settings)
    threads = [
        threading.Thread(target=_normal_client, args=(target, deadline, report, lock), daemon=True)
        for _ in range(settings.normal_clients)
    ]
    threads.append(threading.Thread(target=_health_prober, args=(target, deadline, report), daemon=True))
    if settings.hostile:
        for kind in HOSTILE_KINDS:
            report.outcomes[kind] = Counter()
            report.answer_seconds[kind] = 0.0
            client = _HostileClient(target, kind, report)
            threads.append(threading.Thread(target=client.run, args=(deadline,), daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(settings.duration + settings.timeout + 30)
    report.seconds = time.monotonic() - begin
    return report


class _Target:
    """Where the clients send, and the request bytes each kind sends."""

    def __init__(self, settings: MixSettings) -> None:
        self.settings = settings
        parts = urlsplit(settings.url)
        self.host, self.port = parts.hostname, parts.port or 80

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=self.settings.timeout)

    def head(self, length: int, path: str = "/v1/completions") -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
        ).encode()

    def body(self, **changes: object) -> bytes:
        return json.dumps({**self.settings.normal_body, **changes}).encode()


def _normal_client(target: _Target, deadline: float, report: MixReport, lock: threading.Lock) -> None:
    settings = target.settings
    for i in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= deadline:
            return
        stream = i % 2 == 1
        begin = time.perf_counter()
        try:
            text = _complete(target, stream)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
            text = f"{type(error).__name__}: {error}"
        seconds = time.perf_counter() - begin
        with lock:
            if text == settings.expected_text:
                report.normal_correct += 1
                report.normal_latencies.append(seconds)
            else:
                report.normal_wrong.append(text[:200])


def _complete(target: _Target, stream: bool) -> str:
    """The text of one normal request (a stream's pieces joined); an error's description otherwise."""
    connection = http.client.HTTPConnection(target.host, target.port, timeout=target.settings.timeout)
    try:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/completions", target.body(stream=stream), headers)
        response = connection.getresponse()
        if response.status != 200:
            return f"HTTP {response.status}: {response.read()[:200]!r}"
        if not stream:
            return json.loads(response.read())["choices"][0]["text"]
        pieces = []
        for line in response:
            event = line.decode().strip().removeprefix("data: ")
            if event == "[DONE]":
                return "".join(pieces)
            if event:
                choices = json.loads(event).get("choices") or [{}]
                pieces.append(choices[0].get("text", ""))
        return "stream ended before [DONE]: " + "".join(pieces)
    finally:
        connection.close()


def _health_prober(target: _Target, deadline: float, report: MixReport) -> None:
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= deadline:
            return
        begin = time.perf_counter()
        connection = http.client.HTTPConnection(target.host, target.port, timeout=target.settings.timeout)
        try:
            connection.request("GET", "/health")
            ok = connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            ok = False
        finally:
            connection.close()
        if ok:
            report.health_latencies.append(time.perf_counter() - begin)
        else:
            report.health_failures += 1
        time.sleep(0.25)


class _HostileClient:
    """One client of one hostile kind, in a loop: each try's outcome goes into the report."""

    def __init__(self, target: _Target, kind: str, report: MixReport) -> None:
        self.target = target
        self.kind = kind
        self.report = report
        tries: dict[str, Callable[[float], str]] = {
            "huge body": self._huge_body,
            "lying length": self._lying_length,
            "malformed JSON": lambda deadline: self._send(b'{"prompt": "hello", "max_tokens": '),
            "invalid UTF-8": lambda deadline: self._send(b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 4}'),
            "over-cap max_tokens": lambda deadline: self._send(
                target.body(max_tokens=target.settings.max_tokens_cap + 1)
            ),
            "tiny temperature": self._tiny_temperature,
            "slow sender": self._slow_sender,
            "slow reader": self._slow_reader,
        }
        self.attempt = tries[kind]

    def run(self, deadline: float) -> None:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            begin = time.perf_counter()
            try:
                outcome = self.attempt(deadline)
            except TimeoutError:
                outcome = "no answer within the timeout"
            except OSError as error:
                outcome = f"connection error ({type(error).__name__})"
            self.report.outcomes[self.kind][outcome] += 1
            waited = time.perf_counter() - begin
            self.report.answer_seconds[self.kind] = max(self.report.answer_seconds[self.kind], waited)
            time.sleep(0.05)

    def _send(self, body: bytes) -> str:
        with self.target.connect() as sock:
            sock.sendall(self.target.head(len(body)) + body)
            return _status(sock)

    def _huge_body(self, deadline: float) -> str:
        """Sends the whole declared body unless the server answers first and closes."""
        size = self.target.settings.huge_bytes
        chunk = b"x" * 2**16
        with self.target.connect() as sock:
            sock.sendall(self.target.head(size) + b'{"prompt": "')
            try:
                for _ in range(size // len(chunk)):
                    sock.sendall(chunk)
            except OSError:  # the server answered and closed before taking it all
                return _status(sock, "closed while the body was sent")
            return _status(sock)

    def _lying_length(self, deadline: float) -> str:
        """Declares 10 GB, sends a few bytes."""
        with self.target.connect() as sock:
            sock.sendall(self.target.head(10 * 2**30) + b'{"prompt": "hi"}')
            return _status(sock)

    def _tiny_temperature(self, deadline: float) -> str:
        """1e-300: greedy, so it must get the normal request's own text."""
        with self.target.connect() as sock:
            body = self.target.body(temperature=1e-300)
            sock.sendall(self.target.head(len(body)) + body)
            status, payload = _response(sock)
        if status != "200":
            return status
        text = json.loads(payload)["choices"][0]["text"]
        return "200, the greedy text" if text == self.target.settings.expected_text else "200, another text"

    def _slow_sender(self, deadline: float) -> str:
        """A byte of the body every ``slow_send_seconds``, until the server answers or the deadline."""
        body = self.target.body()
        with self.target.connect() as sock:
            sock.sendall(self.target.head(len(body)))
            sock.settimeout(self.target.settings.slow_send_seconds)
            for byte in body:
                if time.monotonic() >= deadline:
                    return "gave up at the deadline"
                try:
                    sock.sendall(bytes([byte]))
                    return _status(sock)  # waits slow_send_seconds for an answer
                except TimeoutError:
                    continue
                except OSError:
                    break
            sock.settimeout(self.target.settings.timeout)
            return _status(sock, "closed")

    def _slow_reader(self, deadline: float) -> str:
        """A long stream read 64 bytes every ``slow_read_seconds``, until [DONE] or the deadline."""
        settings = self.target.settings
        body = self.target.body(stream=True, max_tokens=settings.max_tokens_cap)
        with self.target.connect() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(self.target.head(len(body)) + body)
            seen = b""
            while time.monotonic() < deadline:
                data = sock.recv(64)
                if not data:
                    return "closed by the server before [DONE]"
                seen = (seen + data)[-64:]
                if b"[DONE]" in seen:
                    return "read to [DONE]"
                time.sleep(settings.slow_read_seconds)
            return "gave up at the deadline (the server was still sending)"


def _status(sock: socket.socket, otherwise: str = "closed without an answer") -> str:
    return _response(sock, otherwise)[0]


def _response(sock: socket.socket, otherwise: str = "closed without an answer") -> tuple[str, bytes]:
    """(the HTTP status, the body) of the answer on ``sock``, read to its end (``Connection: close``)."""
    data = b""
    try:
        while chunk := sock.recv(2**16):
            data += chunk
    except ConnectionResetError:
        pass
    head, _, payload = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/"):
        return otherwise, b""
    return head.split()[1].decode(), payload
