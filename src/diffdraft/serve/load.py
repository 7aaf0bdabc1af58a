"""A bounded load test of a running OpenAI-compatible server (``diffdraft serve-load``).

N client threads send requests (chat or completions, streamed or not) until a request count or a
time limit is reached, and the report gives requests/s, generated tokens/s, latency and time to
first token. Only the standard library is used, so the client adds no load of its own beyond the
sockets. A URL off this machine is refused unless asked for: load tests stay on loopback.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import itertools
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from diffdraft.errors import DiffdraftError

BUILTIN_PROMPTS = (
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash map is.",
    "List three uses of a binary search tree.",
    "def quicksort(xs):",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a process and a thread?",
    "Write a haiku about the sea.",
)


@dataclass
class LoadSettings:
    url: str
    endpoint: str = "chat"
    """"chat" (/v1/chat/completions) or "completions" (/v1/completions)."""
    model: str | None = None
    concurrency: int = 8
    requests: int = 64
    duration: float = 120.0
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = False
    stream: bool = False
    timeout: float = 300.0
    prompts: list[dict] = field(default_factory=lambda: [{"prompt": p} for p in BUILTIN_PROMPTS])
    """Each {"prompt": text} or {"messages": [...]}; a prompt goes to chat as one user message."""
    allow_remote: bool = False
    api_key: str | None = None
    """Sent as ``Authorization: Bearer KEY`` when given."""

    def __post_init__(self) -> None:
        check_url(self.url, self.allow_remote)
        if self.endpoint not in ("chat", "completions"):
            raise DiffdraftError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        for name in ("concurrency", "requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise DiffdraftError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.duration > 0 or not self.timeout > 0:
            raise DiffdraftError(f"--duration and --timeout must be > 0, got {self.duration}, {self.timeout}")
        if not self.prompts:
            raise DiffdraftError("no prompts to send: give a --prompts file with at least one line")
        if self.endpoint == "completions" and any("prompt" not in p for p in self.prompts):
            raise DiffdraftError("--endpoint completions needs plain prompts, not chat messages")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadSettings:
        options = {}
        if args.prompts:
            options["prompts"] = read_prompts(Path(args.prompts))
        return cls(
            url=args.url,
            endpoint=args.endpoint,
            model=args.model,
            concurrency=args.concurrency,
            requests=args.requests,
            duration=args.duration,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            stream=args.stream,
            timeout=args.timeout,
            allow_remote=args.allow_remote,
            api_key=args.api_key,
            **options,
        )


def check_url(url: str, allow_remote: bool) -> None:
    """Refuse a URL whose host is not loopback (names other than localhost are not resolved)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DiffdraftError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise DiffdraftError(
            f"{host} is not a loopback address: serve-load only targets this machine (127.0.0.1, "
            "localhost, ::1) unless you pass --allow-remote for a server you run"
        )


def read_prompts(path: Path) -> list[dict]:
    """A jsonl file: each line a JSON string, {"prompt": text} or {"messages": [...]}."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise DiffdraftError(f"cannot read --prompts {path}: {error.strerror}") from error
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise DiffdraftError(f"{path}:{number} is not JSON ({error}); write one prompt a line") from error
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not ({"prompt", "messages"} & set(item)):
            raise DiffdraftError(
                f'{path}:{number}: expected a string, {{"prompt": ...}} or {{"messages": ...}}'
            )
        prompts.append({key: item[key] for key in ("prompt", "messages") if key in item})
    return prompts


@dataclass
class Sample:
    """One request's outcome."""

    status: int
    """HTTP status (0: no response: connection failure or timeout)."""
    latency: float
    ttft: float | None = None
    """Seconds to the first generated text (streaming only)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tau: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class LoadReport:
    settings: dict
    wall_seconds: float
    samples: list[Sample]

    @property
    def succeeded(self) -> bool:
        return bool(self.samples) and all(s.ok for s in self.samples)

    def summary(self) -> dict:
        ok = [s for s in self.samples if s.ok]
        wall = max(self.wall_seconds, 1e-9)
        taus = [s.tau for s in ok if s.tau is not None]
        errors: dict[str, int] = {}
        for s in self.samples:
            if not s.ok:
                errors[str(s.status)] = errors.get(str(s.status), 0) + 1
        return {
            "requests": len(self.samples),
            "succeeded": len(ok),
            "failed": len(self.samples) - len(ok),
            "errors_by_status": errors,
            "first_error": next((s.error for s in self.samples if s.error), None),
            "wall_seconds": self.wall_seconds,
            "requests_per_second": len(ok) / wall,
            "completion_tokens": sum(s.completion_tokens for s in ok),
            "prompt_tokens": sum(s.prompt_tokens for s in ok),
            "output_tokens_per_second": sum(s.completion_tokens for s in ok) / wall,
            "latency_p50": percentile([s.latency for s in ok], 50),
            "latency_p95": percentile([s.latency for s in ok], 95),
            "ttft_p50": percentile([s.ttft for s in ok if s.ttft is not None], 50),
            "ttft_p95": percentile([s.ttft for s in ok if s.ttft is not None], 95),
            "mean_tau": sum(taus) / len(taus) if taus else None,
        }

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "summary": self.summary(),
            "samples": [asdict(s) for s in self.samples],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class _Client:
    """One keep-alive connection to the server, reopened after a failure."""

    def __init__(self, settings: LoadSettings) -> None:
        self.settings = settings
        parts = urlsplit(settings.url)
        self.https = parts.scheme == "https"
        self.netloc = parts.netloc
        self.base = parts.path.rstrip("/")
        self.conn: http.client.HTTPConnection | None = None
        self.headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = kind(self.netloc, timeout=self.settings.timeout)
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def get_json(self, path: str) -> dict:
        conn = self._connection()
        conn.request("GET", self.base + path, headers=self.headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise DiffdraftError(f"GET {path} answered {response.status}: {body[:200]!r}")
        return json.loads(body)

    def send(self, body: dict) -> Sample:
        path = "/v1/chat/completions" if self.settings.endpoint == "chat" else "/v1/completions"
        begin = time.perf_counter()
        try:
            conn = self._connection()
            conn.request(
                "POST",
                self.base + path,
                body=json.dumps(body),
                headers={"Content-Type": "application/json", **self.headers},
            )
            response = conn.getresponse()
            if response.status != 200:
                text = response.read().decode(errors="replace")
                return Sample(response.status, time.perf_counter() - begin, error=_error_message(text))
            if body.get("stream"):
                return self._read_stream(response, begin)
            data = json.loads(response.read())
            usage = data.get("usage") or {}
            tau = (data.get("diffdraft") or {}).get("tau")
            return Sample(
                200,
                time.perf_counter() - begin,
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                tau=tau,
            )
        except (OSError, http.client.HTTPException, ValueError) as error:
            self.close()
            return Sample(0, time.perf_counter() - begin, error=f"{type(error).__name__}: {error}")

    def _read_stream(self, response: http.client.HTTPResponse, begin: float) -> Sample:
        sample = Sample(200, 0.0)
        while True:
            line = response.readline()
            if not line:
                sample.error = "the stream ended without data: [DONE]"
                self.close()
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                response.read()  # the end of the chunked body, so the connection can be reused
                break
            event = json.loads(payload)
            if "error" in event:
                sample.error = _error_message(json.dumps(event))
                continue
            if sample.ttft is None and any(_choice_text(c) for c in event.get("choices") or []):
                sample.ttft = time.perf_counter() - begin
            stats = event.get("diffdraft") or {}
            if stats:  # on the chunk with the finish reason
                sample.tau = stats.get("tau")
            usage = event.get("usage") or {}
            if usage:
                sample.prompt_tokens = usage.get("prompt_tokens", 0)
                sample.completion_tokens = usage.get("completion_tokens", 0)
        sample.latency = time.perf_counter() - begin
        return sample


def _choice_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def request_body(settings: LoadSettings, prompt: dict, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": settings.max_tokens, "temperature": settings.temperature}
    if settings.endpoint == "chat":
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        body["messages"] = messages
    else:
        body["prompt"] = prompt["prompt"]
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def run_load(settings: LoadSettings) -> LoadReport:
    """Send the requests from ``concurrency`` threads; stops at the count or the time limit."""
    probe = _Client(settings)
    try:
        model = settings.model or probe.get_json("/v1/models")["data"][0]["id"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as error:
        raise DiffdraftError(
            f"no OpenAI-compatible server answered at {settings.url} ({type(error).__name__}: {error}); "
            "start one with `diffdraft serve` or fix --url"
        ) from error
    finally:
        probe.close()
    numbers = itertools.count()
    lock = threading.Lock()
    samples: list[Sample] = []
    begin = time.perf_counter()
    deadline = begin + settings.duration

    def client_loop() -> None:
        client = _Client(settings)
        try:
            while time.perf_counter() < deadline:
                with lock:
                    number = next(numbers)
                if number >= settings.requests:
                    return
                prompt = settings.prompts[number % len(settings.prompts)]
                sample = client.send(request_body(settings, prompt, model))
                with lock:
                    samples.append(sample)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(settings.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begin
    described = {k: v for k, v in asdict(settings).items() if k != "prompts"}
    described.update(model=model, prompts=len(settings.prompts))
    return LoadReport(described, wall, samples)


def format_report(report: LoadReport) -> str:
    """The summary as an aligned table."""
    s = report.summary()
    settings = report.settings

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    rows = [
        ("server", f"{settings['url']} ({settings['model']}, {settings['endpoint']})"),
        ("clients", f"{settings['concurrency']}, stream: {'yes' if settings['stream'] else 'no'}"),
        ("requests", f"{s['succeeded']} ok, {s['failed']} failed in {s['wall_seconds']:.1f} s"),
        ("requests/s", f"{s['requests_per_second']:.2f}"),
        ("output tokens/s", f"{s['output_tokens_per_second']:.1f} ({s['completion_tokens']} tokens)"),
        ("latency p50 / p95", f"{seconds(s['latency_p50'])} / {seconds(s['latency_p95'])}"),
        ("first token p50 / p95", f"{seconds(s['ttft_p50'])} / {seconds(s['ttft_p95'])}"),
        ("mean tau", "-" if s["mean_tau"] is None else f"{s['mean_tau']:.2f}"),
    ]
    if s["failed"]:
        rows.append(("errors", f"{s['errors_by_status']}; first: {s['first_error']}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
