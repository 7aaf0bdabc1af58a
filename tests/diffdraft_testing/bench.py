"""Stand-ins for the benchmark's methods, reference target and records."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from diffdraft.bench.lossless import LosslessChecker
from diffdraft.bench.methods import STAGE_NAMES, Completion, MethodSpec, Request
from diffdraft.bench.records import Record
from diffdraft.budget.cost import VerifyCostCurve


class FixedLogits(nn.Module):
    """A 'float32 target' whose next-token logits are always the same."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.tensor(logits)
        self.seen: list[list[int]] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, logits_to_keep=0):
        self.seen.append(input_ids[0].tolist())
        return SimpleNamespace(logits=self.logits[None, None])


TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class Stub:
    """A method that answers with fixed tokens, optionally one token off, and logs its calls."""

    def __init__(self, label: str, log: list, reply: list[int], off_at: int | None = None) -> None:
        self.spec = MethodSpec.parse(label)
        self.dtype = torch.float32
        self.log = log
        self.reply = reply
        self.off_at = off_at

    def generate(self, request: Request) -> Completion:
        self.log.append(
            (self.spec.label, tuple(request.prompt_token_ids), request.max_new_tokens, request.seed)
        )
        tokens = list(self.reply[: request.max_new_tokens])
        if self.off_at is not None and self.off_at < len(tokens):
            tokens[self.off_at] += 1
        stages = dict.fromkeys(STAGE_NAMES, 0.001)
        return Completion(tokens, 0.01, [1] * (len(tokens) - 1), stages, [1] * (len(tokens) - 1))


def checker(tolerance: float = 0.0) -> LosslessChecker:
    return LosslessChecker(lambda: FixedLogits([0.0, 5.0, 9.0, 8.0, 1.0]), tolerance)


def record(
    method: str,
    repeat: int,
    seconds: float,
    lengths: list[int],
    sizes: int = 1,
    draft: float = 0.0,
    engine: str = "diffdraft",
    prefill: float = 0.0,
):
    tokens = list(range(1 + sum(lengths)))
    stages = dict.fromkeys(STAGE_NAMES, 0.0) | {"draft": draft, "prefill": prefill}
    done = Completion(
        tokens,
        seconds,
        lengths,
        stages,
        [sizes] * len(lengths),
        [0.01] * len(lengths),
        verify_contexts=[5 + sum(lengths[:i]) for i in range(len(lengths))],
        draft_depths=[sizes - 1] * len(lengths),
        engine=engine,
    )
    return Record("set", "s", 0, 0.0, repeat, method, 5, done, compared=method != "ar")


# verifying gets dearer with the cache: +0.01 s per 100 cached tokens
CURVE = VerifyCostCurve(sizes=[1, 64], contexts=[0, 100], seconds=[[0.01, 0.02], [0.02, 0.03]])
