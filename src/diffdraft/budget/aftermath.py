"""What a drafting round costs the plain rounds after it.

On a CPU whose last-level cache holds most of the target's weights (a 260 MB L3 holds SmolLM2-135M's
134 MB of int8 blocks), a drafting round's drafter forward and wider verification push some of them
out, and the plain forwards after it run slower until they are back: on a 2-core Xeon the seven
plain rounds after a drafted one took ~1 ms more in all at batch 1 and ~2.2 ms at batch 2, against
one-token forwards of 3.0 and 3.6 ms (figures: benchmarks/README.md, 'Measurements behind the code').
A plan that priced drafting by its own round alone drafted where it lost. Where the weights stream
from memory every forward anyway, the slowdown measures as nothing and changes no plan.
"""

from __future__ import annotations

import statistics

from diffdraft.runtime.stats import GenerationStats

AFTERMATH_ROUNDS = 8
"""Plain rounds after a drafted one that may still run slow; those further from any drafting (and from
the prompt, and from a change of the batch) run steady."""
MIN_STEADY_ROUNDS = 8
"""Steady plain forwards of a shape a sequence needs before its slow ones can be told from them."""


def aftermath_seconds(stats: GenerationStats, rounds: int = AFTERMATH_ROUNDS) -> float:
    """What a finished sequence's plain forwards within ``rounds`` rounds after its drafted rounds took
    beyond its steady plain forwards of the same number of sequences, summed (0 where it had too few
    steady ones of a shape; below 0 where noise says so: the planner takes the median over sequences,
    and clipping each at 0 would bias it up). Drafted rounds within ``rounds`` of the prompt or of a change
    of the batch are left out: the plain forwards there run slow with or without them."""
    forwards, seconds = stats.verify_forwards, stats.verify_seconds
    drafted = stats.drafter_sizes()
    steady: dict[int, list[float]] = {}
    slow: list[tuple[int, float]] = []
    settled = quiet = 0  # rounds since the prompt or a change of the batch; since drafting, too
    after = None  # plain rounds since the last drafted round counted, while no other drafting came
    for index, (forward, taken) in enumerate(zip(forwards, seconds, strict=True)):
        sequences, tokens = forward[0], forward[1]
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
            # alone it verified a free copy: no forward of the drafter's, and no plain forward to time
        elif after is not None and after < rounds:
            after += 1
            slow.append((sequences, taken))
        elif quiet > rounds:
            steady.setdefault(sequences, []).append(taken)
    typical = {n: statistics.median(s) for n, s in steady.items() if len(s) >= MIN_STEADY_ROUNDS}
    return sum(taken - typical[n] for n, taken in slow if n in typical)
