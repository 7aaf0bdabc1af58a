"""What one sequence is generated from, as one value: the loop, the batch and every caller hand it on
whole instead of the same six arguments each."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffdraft.runtime.logprobs import LogprobRecorder
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate (:meth:`~diffdraft.decoding.engine.SpeculativeEngine.run`,
    :meth:`~diffdraft.decoding.batching.BatchEngine.add`)."""

    prompt_ids: list[int]
    stop: StopConditions
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Greedy unless told otherwise."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    """Filled in as the sequence runs: the caller keeps it to read acceptance and stage times."""
    seed: int | None = None
    """Seeds the sequence's own random stream (None: the global one), so its sampled output does not
    depend on the sequences it shares rounds with."""
    logprobs: LogprobRecorder | None = None
    """Gets the target's log-probability of every token the sequence commits (None: not recorded)."""
