"""Which plain forwards run steady, and what a drafting round costs the plain ones after it.

On a CPU whose last-level cache holds most of the target's weights (a 260 MB L3 holds SmolLM2-135M's
134 MB of int8 blocks), a drafting round's drafter forward and wider verification push some of them
out, and the plain forwards after it run slower until they are back, by a good share of a plain
round over the next several; the prompt's prefill slows the next rounds alike. Timed right after
drafting, a plain round reads dearer than plain decoding's rounds run, and a plan that read so kept
drafting where it lost (docs/decisions.md, "plain rounds timed where they run steady"). Where
the weights stream from memory every forward anyway, the slowdown measures as nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from diffdraft.runtime.stats import GenerationStats

AFTERMATH_ROUNDS = 8
"""Plain rounds after a drafted one (or the prompt, or a change of the batch) that may still run slow."""
MIN_STEADY_ROUNDS = 8
"""Steady plain forwards of a shape a sequence needs before its slow ones can be told from them."""


@dataclass(frozen=True)
class PlainForwards:
    """A finished sequence's plain forwards (one token a sequence), by how they ran."""

    steady: list[bool]
    """Per round, whether it was a plain forward more than :data:`AFTERMATH_ROUNDS` rounds after the
    prompt, any drafting and any change of the number of sequences: as plain decoding runs."""
    slowed: list[int]
    """The plain rounds within :data:`AFTERMATH_ROUNDS` after one of the sequence's own drafted rounds
    (one far enough from the prompt and from a change of the batch that they would have run steady),
    with no other drafting between."""


def plain_forwards(stats: GenerationStats) -> PlainForwards:
    """:class:`PlainForwards` of ``stats``. Drafting is a round of the sequence's own drafter or, in a
    shared forward, any tree or copy (another sequence may have drafted it); a lone copy is neither
    drafting nor a plain forward."""
    forwards, rounds = stats.verify_forwards, AFTERMATH_ROUNDS
    drafted = stats.drafter_sizes()
    steady, slowed = [False] * len(forwards), []
    settled = quiet = 0  # rounds since the prompt or a change of the batch; since drafting, too
    after = None  # plain rounds since the last drafted round counted, while no other drafting came
    for index, (sequences, tokens, _) in enumerate(forwards):
        settled, quiet = settled + 1, quiet + 1
        if index and sequences != forwards[index - 1][0]:
            settled = quiet = 1
            after = None
        if drafted[index]:
            quiet = 0
            after = 0 if settled > rounds else None
        elif tokens > sequences:
            if sequences > 1:  # what shared this forward may have drafted
                quiet, after = 0, None
        elif after is not None and after < rounds:
            after += 1
            slowed.append(index)
        else:
            steady[index] = quiet > rounds
    return PlainForwards(steady, slowed)


def aftermath_seconds(stats: GenerationStats, plain: PlainForwards) -> float:
    """What the sequence's slowed plain forwards (``plain``: its :func:`plain_forwards`) took beyond
    its steady ones of the same number of sequences, summed (0 where it had too few steady ones of a
    shape; below 0 where noise says so: the planner takes a median over sequences, and clipping each
    at 0 would bias it up)."""
    shapes: dict[int, list[float]] = {}
    for index, steady in enumerate(plain.steady):
        if steady:
            shapes.setdefault(stats.verify_forwards[index][0], []).append(stats.verify_seconds[index])
    typical = {n: statistics.median(s) for n, s in shapes.items() if len(s) >= MIN_STEADY_ROUNDS}
    slowed = [(stats.verify_forwards[i][0], stats.verify_seconds[i]) for i in plain.slowed]
    return sum(seconds - typical[n] for n, seconds in slowed if n in typical)
