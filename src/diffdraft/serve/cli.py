"""``diffdraft serve`` (the OpenAI-compatible server) and ``diffdraft serve-load`` (a load client for
one). The web stack is imported only when a command runs, so other commands do not pay for it."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from diffdraft.commands.model_options import add_model_arguments, load_generator
from diffdraft.errors import DiffdraftError
from diffdraft.serve.limits import (
    DEFAULT_BODY_SECONDS,
    DEFAULT_HEADER_SECONDS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS_CAP,
    ServerLimits,
)
from diffdraft.target.default_model import MODEL_NAME

if TYPE_CHECKING:
    import uvicorn

API_KEY_VARIABLE = "DIFFDRAFT_API_KEY"
"""Where ``serve`` and ``serve-load`` read the API key when no --api-key (or --api-key-file) is given."""


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the target (and drafter) over an OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
        "Requests share each round's target forward (continuous batching); outputs are exactly "
        "the target's own.",
    )
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--max-batch-size", type=int, default=8, help="requests generated together per round (default: 8)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a batch slot; more get HTTP 429 (default: 64)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model name clients send and /v1/models lists (default: {MODEL_NAME} for "
        "--target default, else --target as given, as vLLM names it)",
    )
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require this key on /v1 routes as 'Authorization: Bearer KEY' (/health and /metrics stay "
        "open); other users of this machine can read it in the process list: prefer --api-key-file or "
        f"${API_KEY_VARIABLE}, which is the default (else no key)",
    )
    key.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from this file (its first line)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get HTTP 413, before they are parsed (default: %(default)s, 4 MiB)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=DEFAULT_MAX_TOKENS_CAP,
        help="a request for more completion tokens gets HTTP 400; one that names none gets at most this "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_SECONDS,
        metavar="SECONDS",
        help="a request body still arriving after this long gets HTTP 408 (default: %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_SECONDS,
        metavar="SECONDS",
        help="a connection that has sent no whole request's headers this long after it opened or after "
        "its last response is closed (default: %(default)s)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve the interactive API docs at /docs, /redoc and /openapi.json (off by default)",
    )
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="server log level (default: info)",
    )


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return MODEL_NAME if args.target == "default" else str(args.target)


def api_key(args: argparse.Namespace) -> str | None:
    """The key ``serve`` requires: --api-key, else --api-key-file's first line, else
    $DIFFDRAFT_API_KEY, else none. Error messages never show it."""
    if args.api_key_file is None:
        return args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    try:
        with open(args.api_key_file, encoding="utf-8") as file:
            key = file.readline().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise DiffdraftError(f"cannot read --api-key-file {args.api_key_file}: {error}") from None
    if not key:
        raise DiffdraftError(
            f"--api-key-file {args.api_key_file} has no key on its first line: write the key there"
        )
    return key


def server_limits(args: argparse.Namespace) -> ServerLimits:
    try:
        return ServerLimits(
            args.max_request_bytes, args.max_tokens_cap, args.body_timeout, args.header_timeout
        )
    except ValueError:
        raise DiffdraftError(
            "need --max-request-bytes >= 1, --max-tokens-cap >= 1, --body-timeout > 0 and --header-timeout "
            f"> 0, got {args.max_request_bytes}, {args.max_tokens_cap}, {args.body_timeout} and "
            f"{args.header_timeout}"
        ) from None


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket before the (slow) model load, so a busy port fails at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, ValueError) as error:
        raise DiffdraftError(f"cannot listen on {host}:{port} ({error}): check --host") from error
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise DiffdraftError(
            f"cannot listen on {host}:{port} ({error.strerror}): another process may use the port; "
            "pass a free one with --port"
        ) from error
    sock.set_inheritable(True)
    return sock


@contextmanager
def _stop_signals_shut_down(server: uvicorn.Server) -> Iterator[None]:
    """Ctrl-C or SIGTERM start ``server``'s graceful shutdown (a second Ctrl-C forces it), as uvicorn
    does when it runs in the main thread: here it does not, the rounds do (see :func:`run_serve`)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; its caller stops the server
        return
    previous = {stop: signal.signal(stop, server.handle_exit) for stop in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)


def run_serve(args: argparse.Namespace) -> int:
    """Open the port, load, then serve until interrupted (Ctrl-C finishes the requests in flight
    first).

    The port answers from the first second: while the model loads (a fresh cache converts it and
    compiles the kernels, minutes on a small CPU), /health says "loading" and requests get 503 with
    Retry-After, so an orchestrator sees a live process and clients a reason (a port that opened
    only after the load refused connections for ten minutes with no word). The thread that loaded the
    models runs the rounds (:meth:`Scheduler.run`) and the HTTP server runs beside it: a CPU target
    decodes several times slower in a thread started after the load (see
    :mod:`diffdraft.serve.scheduler`)."""
    import uvicorn

    from diffdraft.serve.app import create_app
    from diffdraft.serve.request_deadline import uvicorn_config
    from diffdraft.serve.scheduler import Scheduler, times_shared_forwards

    if args.max_batch_size < 1 or args.max_queue < 0:
        raise DiffdraftError(
            f"need --max-batch-size >= 1 and --max-queue >= 0, got {args.max_batch_size} and {args.max_queue}"
        )
    limits = server_limits(args)
    key = api_key(args)
    name = served_model_name(args)
    sock = listen(args.host, args.port)
    app = create_app(None, name, api_key=key, limits=limits, docs=args.docs)
    readiness = app.state.readiness
    server = uvicorn.Server(uvicorn_config(app, limits.header_timeout, args.log_level))
    scheduler: Scheduler | None = None

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            if scheduler is not None:
                scheduler.close()  # ends scheduler.run() below

    http = threading.Thread(target=serve_http, name="diffdraft-http")
    try:
        http.start()
        print(
            f"diffdraft serve: http://{args.host}:{args.port} open (/health says 'loading'); "
            f"loading {args.target} ({args.method})...",
            file=sys.stderr,
            flush=True,
        )
        generator = load_generator(args)
        if times_shared_forwards(generator, args.max_batch_size):
            readiness.stage = "timing the target's shared forwards for budget 'auto'"
        scheduler = Scheduler(generator, args.max_batch_size, args.max_queue)
        # what is loaded now lives as long as the server: out of the collector's full passes, each of
        # which walked all of it and stalled every request in flight (docs/decisions.md, "frozen
        # garbage after the server's load")
        gc.freeze()
        readiness.ready(scheduler)
        guarded = ", API key required" if key else ""
        print(
            f"diffdraft serve: model {name!r} ready on http://{args.host}:{args.port}/v1 "
            f"(batch {args.max_batch_size}, queue {args.max_queue}{guarded})",
            file=sys.stderr,
            flush=True,
        )
        if http.is_alive():  # the server did not stop while the model loaded
            with _stop_signals_shut_down(server):
                scheduler.run()
    finally:
        server.should_exit = True  # when the load or the rounds failed; else it has stopped already
        http.join()
        sock.close()
    print("diffdraft serve: stopped", file=sys.stderr, flush=True)
    return 0


def add_serve_load_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-load",
        help="put a running diffdraft (or any OpenAI-compatible) server under load and report throughput",
        description="Send requests from N concurrent clients to a running server until --requests "
        "are done or --duration has passed; report requests/s, tokens/s, latency and time to first "
        "token (p50/p95) as a table and JSON. Starts nothing itself.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a URL that is not on this machine (loopback only by default)",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_VARIABLE}, else none)",
    )
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default: 8)")
    p.add_argument("--requests", type=int, default=64, help="requests in all (default: 64)")
    p.add_argument(
        "--duration", type=float, default=120.0, help="stop sending after this many seconds (default: 120)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate max-tokens every time (vLLM extension)"
    )
    p.add_argument("--stream", action="store_true", help="stream, which also measures time to first token")
    p.add_argument(
        "--prompts",
        default=None,
        help="jsonl file, one {'prompt': TEXT} or {'messages': [...]} or a JSON string a line "
        "(default: a few built-in prompts)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default: 300)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the report as JSON here")


def run_serve_load(args: argparse.Namespace) -> int:
    from diffdraft.serve.load import LoadSettings, format_report, run_load

    settings = LoadSettings.from_args(args)
    report = run_load(settings)
    print(format_report(report))
    if args.json_out:
        report.write_json(args.json_out)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0 if report.succeeded else 1
