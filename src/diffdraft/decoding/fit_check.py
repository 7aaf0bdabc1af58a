"""Saying once that a drafter does not fit its target.

A drafter trained for another target or tokenizer, tapping other layers than it learnt from, or read
against a target in another precision or quantization than its training's still runs: it drafts, its
drafts are rejected, and the output stays exactly the target's. Only the speed is gone, and users of
every engine have reported such silent pairs at about no acceptance. So the engine watches the first
rounds its drafter drafts (across sequences: a server's first requests too) and, when almost nothing
it drafted was accepted, says so once with the likely causes and what to try.

Prompt lookup is not judged: its drafts are copies of the context, and text that does not repeat
itself accepts none of them without anything being wrong.
"""

from __future__ import annotations

import sys

from diffdraft.drafters.base import Drafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter

JUDGED_ROUNDS = 32
"""Drafted rounds watched before judging: enough that a fitting drafter's acceptance shows."""
FLOOR = 0.1
"""Accepted drafted tokens a round below which the pair is reported: fewer than one in ten rounds
(a drafter that fits accepts one or more a round; tau 1.1 would not pay for its drafting anyway)."""


class FitCheck:
    """Counts the drafted tokens accepted over the first :data:`JUDGED_ROUNDS` drafted rounds."""

    def __init__(self, drafter: Drafter | None) -> None:
        self.done = drafter is None or isinstance(drafter, PromptLookupDrafter)
        self.rounds = 0
        self.accepted = 0
        self.warned = False

    def record(self, accepted: int) -> None:
        """One drafted round (not a copy) in which ``accepted`` drafted tokens were accepted."""
        if self.done:
            return
        self.rounds += 1
        self.accepted += accepted
        if self.rounds < JUDGED_ROUNDS:
            return
        self.done = True
        mean = self.accepted / self.rounds
        if mean < FLOOR:
            self.warned = True
            print(
                f"diffdraft: warning: over the first {self.rounds} drafted rounds the target accepted "
                f"{mean:.2f} drafted tokens a round: this drafter does not fit this target (the output is "
                "still the target's own, only slower). Likely causes: a drafter trained for another target "
                "or tokenizer, target layer ids other than its training's, a target in another precision "
                "or quantization than it was trained against, or an untrained drafter. Measure the pair "
                "with `diffdraft train eval --drafter DRAFTER --target TARGET`, or decode with method "
                "'pld' or 'ar'",
                file=sys.stderr,
            )
