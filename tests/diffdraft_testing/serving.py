"""The real uvicorn server in a background thread on a free loopback port, and the tiny target the
serve tests share (a saved checkpoint whose tokenizer has a chat template)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from diffdraft.serve.app import create_app
from diffdraft.serve.cli import listen
from diffdraft.serve.limits import ServerLimits
from diffdraft.serve.request_deadline import uvicorn_config
from diffdraft.serve.scheduler import Scheduler

from diffdraft_testing.checkpoints import make_checkpoint

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_chat_checkpoint(path: Path) -> Path:
    """make_checkpoint's tiny Llama with peaked next-token distributions (weights drawn with std 0.2,
    as tiny_target does), so greedy outputs have no float32 near-ties that batched and
    single verification could break differently, and with a chat template for /v1/chat/completions."""
    make_checkpoint(path, "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


class LiveServer:
    """``with LiveServer(app) as server: server.url`` serves ``app`` until the block ends."""

    def __init__(self, app, log_level: str = "warning") -> None:
        self.socket = listen("127.0.0.1", 0)
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        header_timeout = app.state.readiness.limits.header_timeout  # as `diffdraft serve` runs it
        self.server = uvicorn.Server(uvicorn_config(app, header_timeout, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.socket.close()


@contextmanager
def serving(
    generator,
    model: str = "tiny",
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    **scheduler_options,
) -> Iterator[LiveServer]:
    """A started scheduler over ``generator`` behind a live server (under ``limits``, None: the
    defaults); both stop when the block ends."""
    scheduler = Scheduler(generator, **scheduler_options).start()
    try:
        with LiveServer(create_app(scheduler, model, api_key=api_key, limits=limits)) as live:
            live.scheduler = scheduler
            yield live
    finally:
        scheduler.close()
