"""Requests decoded alone and in continuous batches: for the tests that batching changes no output, and
for the sampling-exactness test's many seeded draws."""

from __future__ import annotations

import torch

from diffdraft.decoding.batching import BatchEngine
from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions


def requests_for(target, seed: int, count: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_new_tokens, seed) per request: motifs repeated so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    made = []
    for i in range(count):
        length = int(torch.randint(1, 20, (), generator=g))
        motif = torch.randint(1, vocab - 1, (max(1, length // 3),), generator=g).tolist()
        made.append(((motif * 3 + [5])[:length], int(torch.randint(1, 30, (), generator=g)), seed * 31 + i))
    return made


def alone(
    engine: SpeculativeEngine,
    request,
    sampling: SamplingParams,
    stats: GenerationStats | None = None,
    eos: int | None = None,
) -> list[int]:
    """The tokens ``engine`` decodes for ``request`` (from :func:`requests_for`) on its own, through
    :meth:`SpeculativeEngine.run`; ``eos``: the end token (None: the target's last; -1: none)."""
    prompt, max_new_tokens, seed = request
    stop = _stop(engine, prompt, max_new_tokens, eos)
    stats = stats if stats is not None else GenerationStats()
    return [t for chunk in engine.run(SequenceSpec(prompt, stop, sampling, stats, seed)) for t in chunk]


def batched(
    engine: SpeculativeEngine,
    requests,
    sampling: SamplingParams,
    max_batch: int,
    stats: list[GenerationStats] | None = None,
    eos: int | None = None,
) -> list[list[int]]:
    """Continuous batching: at most ``max_batch`` at once; a waiting request joins when one leaves.
    ``stats``: one per request, to read afterwards; ``eos``: as :func:`alone`'s."""
    stats = stats if stats is not None else [GenerationStats() for _ in requests]
    batch = BatchEngine(engine)
    outputs: list[list[int]] = [[] for _ in requests]
    index_of = {}
    waiting = list(enumerate(requests))
    while waiting or batch.active:
        while waiting and len(batch.active) < max_batch:
            i, (prompt, max_new_tokens, seed) = waiting.pop(0)
            stop = _stop(engine, prompt, max_new_tokens, eos)
            sequence, first = batch.add(SequenceSpec(prompt, stop, sampling, stats[i], seed))
            index_of[sequence] = i
            outputs[i].extend(first)
        for sequence, new in batch.step():
            outputs[index_of[sequence]].extend(new)
    return outputs


def _stop(engine: SpeculativeEngine, prompt: list[int], new_tokens: int, eos: int | None) -> StopConditions:
    """A request's stop: ``new_tokens`` tokens, or ``eos`` (None: the target's last token) first."""
    end = engine.target.vocab_size - 1 if eos is None else eos
    return StopConditions([end], new_tokens, engine.target.max_context, len(prompt))
