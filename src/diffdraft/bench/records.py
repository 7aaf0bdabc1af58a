"""What the benchmark records of one prompt turn: a :class:`Record` per method, keyed by :data:`TurnKey`.

Apart from the loop that makes them (:mod:`diffdraft.bench.runner`), so the journal that stores them
and the summary that reads them need not import the loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from diffdraft.bench.methods import Completion

TurnKey = tuple[str, str, int, float, int]
"""(dataset, sample id, turn, temperature, repeat): one prompt turn of one repeat."""


@dataclass
class Record:
    """One method's generation of one prompt turn in one repeat."""

    dataset: str
    sample_id: str
    turn: int
    temperature: float
    repeat: int
    method: str
    prompt_tokens: int
    completion: Completion
    compared: bool = False
    """Whether the tokens were checked against plain AR (greedy, same dtype)."""
    divergence: dict | None = None

    @property
    def key(self) -> TurnKey:
        return (self.dataset, self.sample_id, self.turn, self.temperature, self.repeat)

    def to_dict(self) -> dict:
        fields = asdict(self)
        fields.update(fields.pop("completion"))
        return fields
