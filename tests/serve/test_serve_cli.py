"""``diffdraft serve``: the command serves until stopped, fails fast on a busy port or bad sizes,
and loads what ``generate`` would load for the same options."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import diffdraft.commands.model_options
import diffdraft.serve.cli
from diffdraft.cli import main
from diffdraft.errors import CheckpointError
from diffdraft.serve.cli import add_serve_parser, served_model_name
from diffdraft.target.model import TargetModel

from diffdraft_testing.serving import make_chat_checkpoint


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *args])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(port: int, running) -> None:
    """Until the server on ``port`` answers /health with 200 (a minute at most, while ``running()``)."""
    deadline = time.monotonic() + 60
    while True:
        assert running() and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def test_defaults_match_generate_and_a_local_server():
    args = parse()
    assert (args.target, args.method, args.drafter, args.budget, args.dtype) == (
        "default",
        "ar",
        None,
        None,  # each method's default: auto for the DDTree methods, 32 for dart
        "auto",
    )
    assert (args.host, args.port, args.max_batch_size, args.max_queue) == ("127.0.0.1", 8000, 8, 64)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((), "SmolLM2-135M-Instruct"),
        (("--target", "models/qwen3-8b"), "models/qwen3-8b"),
        (("--target", "models/qwen3-8b", "--served-model-name", "qwen"), "qwen"),
    ],
)
def test_the_served_model_name_defaults_to_the_target(args, name):
    assert served_model_name(parse(*args)) == name


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the command gets as far as loading a model."""
    asked = {}

    def load(target, drafter, method, *rest):
        asked.update(target=target, drafter=drafter, method=method)
        raise CheckpointError(f"the {drafter} drafter is missing from this installation")

    monkeypatch.setattr(diffdraft.commands.model_options, "load", load)
    return asked


def test_bad_batch_or_queue_sizes_exit_2_before_loading(no_load, capsys):
    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "--max-batch-size >= 1" in capsys.readouterr().err
    assert no_load == {}


def test_a_busy_port_exits_2_before_loading(no_load, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    assert "pass a free one with --port" in capsys.readouterr().err
    assert no_load == {}


@pytest.mark.parametrize(
    ("method", "drafter"), [("ddtree+pld", "default"), ("deer", "default-deer"), ("pld", "default")]
)
def test_the_default_drafter_follows_the_method_as_in_generate(no_load, capsys, method, drafter):
    port = free_port()
    assert main(["serve", "--method", method, "--port", str(port)]) == 2
    assert no_load == {"target": "default", "drafter": drafter, "method": method}
    assert "drafter is missing" in capsys.readouterr().err
    with socket.socket() as again:  # the failed start let go of its port
        again.bind(("127.0.0.1", port))


@pytest.fixture
def servers(monkeypatch) -> list[uvicorn.Server]:
    """Every uvicorn server the command makes, so a test can tell it to exit."""
    made = []

    class Recorded(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            made.append(self)

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    return made


def test_the_command_serves_until_the_server_is_told_to_exit(tmp_path, monkeypatch, servers):
    checkpoint = make_chat_checkpoint(tmp_path / "target")
    forwards = []
    verify_batch = TargetModel.verify_batch
    monkeypatch.setattr(
        TargetModel,
        "verify_batch",
        lambda *args: forwards.append(threading.current_thread()) or verify_batch(*args),
    )
    port = free_port()
    args = ["serve", "--target", str(checkpoint), "--method", "pld", "--port", str(port)]
    args += ["--served-model-name", "tiny", "--max-batch-size", "2", "--log-level", "warning"]
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(args)))
    thread.start()
    wait_until_healthy(port, thread.is_alive)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens <= 3
    assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
    servers[0].should_exit = True
    thread.join(30)
    assert not thread.is_alive() and codes == [0]
    # the rounds ran in the thread that loaded the models (a CPU target decodes far slower in another)
    assert forwards and set(forwards) == {thread}


def test_the_port_answers_while_the_model_loads(tmp_path, monkeypatch, servers):
    """/health says "loading" (503) and requests get a 503 to retry from the first second; once
    loaded, the same server answers them."""
    checkpoint = make_chat_checkpoint(tmp_path / "target")
    loading = threading.Event()
    load_generator = diffdraft.serve.cli.load_generator

    def slow_load(args):
        assert loading.wait(60)
        return load_generator(args)

    monkeypatch.setattr(diffdraft.serve.cli, "load_generator", slow_load)
    port = free_port()
    args = ["serve", "--target", str(checkpoint), "--method", "pld", "--port", str(port)]
    args += ["--served-model-name", "tiny", "--log-level", "warning"]
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(args)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the port did not open before the load"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.TransportError:
                time.sleep(0.02)
        assert health.status_code == 503
        assert health.json() == {"status": "loading", "model": "tiny", "stage": "loading the model"}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        early = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat)
        assert early.status_code == 503 and early.headers["retry-after"] == "1"
        assert "still starting (loading the model); retry" in early.json()["error"]["message"]
        loading.set()
        wait_until_healthy(port, thread.is_alive)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        loading.set()
        for server in servers:
            server.should_exit = True
        thread.join(30)
    assert codes == [0]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stop_the_process_cleanly(tmp_path, stop):
    checkpoint = make_chat_checkpoint(tmp_path / "target")
    port = free_port()
    command = [sys.executable, "-m", "diffdraft.cli", "serve", "--target", str(checkpoint), "--method", "pld"]
    command += ["--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        wait_until_healthy(port, lambda: process.poll() is None)
        process.send_signal(stop)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert "diffdraft serve: stopped" in err and "Traceback" not in err
