"""A benchmark sample, and the ShareGPT slice held out for the benchmark: training and the n-gram
corpus leave that slice out, the benchmark measures on it."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffdraft.data.prompts import ReadReport, read_json_array, sharegpt_path

SHAREGPT_HELD_OUT = 500
"""The last this-many prompts of the built-in ShareGPT dump are kept out of drafter training."""


@dataclass
class Sample:
    """One benchmark conversation. Exactly one of ``messages`` (chat) and ``prompt`` (plain) is set."""

    id: str
    dataset: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    followups: list[str] = field(default_factory=list)
    """User turns asked after the reference reply to the previous turn (chat samples only)."""

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


def sharegpt_held_out() -> list[Sample]:
    """The last :data:`SHAREGPT_HELD_OUT` prompts of the built-in ShareGPT dump, up to the first user turn."""
    report = ReadReport("sharegpt")
    prompts = list(read_json_array(sharegpt_path(), report))[-SHAREGPT_HELD_OUT:]
    return [Sample(id=p.id, dataset="sharegpt", messages=p.messages) for p in prompts]
