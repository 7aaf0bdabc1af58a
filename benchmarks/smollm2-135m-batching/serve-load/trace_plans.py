"""`diffdraft serve` with the auto budget's lone-round plans and learning written to a JSON-lines file.

Why a sequence drafts or not is in numbers no report shows: its estimated acceptance per budget,
the cost curve as rescaled, the drafting and entry costs and calibrations the planner learned from
finished sequences. This runs the server with two hooks that log them (issue 86's batch-1 trace):

    PLAN_LOG=/tmp/plans.jsonl python trace_plans.py serve --target default --method ddtree+pld \
        --budget auto --dtype bfloat16 --port 8031

then load it with `diffdraft serve-load`. Each lone round's plan is a line `{"event": "plan", ...}`
(round, budget, surrogates, expected tau and forward milliseconds by tokens, drafting and commit
milliseconds); each finished sequence a line `{"event": "finished", ...}` (its rounds, drafted
rounds, copies, tau, tree sizes, catch-up drafts, and the planner's records after learning it).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from diffdraft.budget import round_budget
from diffdraft.cli import main
from diffdraft.runtime.stats import GenerationStats

LOG = open(os.environ.get("PLAN_LOG", "plans.jsonl"), "a", buffering=1)  # noqa: SIM115 (open while the process runs)
Planner = round_budget.RoundBudgetPlanner
planned, learned = Planner.plan, Planner.observe_generation


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 2)


def plan_and_log(self: Planner, sequences: list) -> list[int]:
    budgets = planned(self, sequences)
    if len(sequences) == 1:
        stats = sequences[0].stats
        taus, context, own, entering = self._round
        verify, draft, commit = self.round_costs(taus, context, own, entering)
        line = {
            "event": "plan",
            "round": len(stats.tree_sizes),
            "budget": budgets[0],
            "surrogates": len(stats.surrogates),
            "tau": [round(tau, 2) for tau in taus[0][:10]],
            "verify_ms": [ms(seconds) for seconds in verify[:11]],
            "draft_ms": ms(draft),
            "commit_ms": ms(commit),
            "entering": entering,
        }
        LOG.write(json.dumps(line) + "\n")
    return budgets


def learn_and_log(self: Planner, stats: GenerationStats) -> None:
    learned(self, stats)
    gains, counts = self.planner.rank_gains()
    line = {
        "event": "finished",
        "alone": all(forward[0] == 1 for forward in stats.verify_forwards),
        "rounds": stats.rounds,
        "drafted": sum(size > 0 for size in stats.drafter_sizes()),
        "copies": len(stats.copy_rounds),
        "tau": round(stats.tau, 2),
        "tree_sizes": stats.tree_sizes,
        "catch_up_draft_ms": [ms(seconds) for seconds in stats.catch_up_draft_seconds],
        "stage_ms": {stage: ms(seconds) for stage, seconds in stats.timings.items()},
        "kept_per_rank": np.round(gains / np.maximum(counts, 1), 2)[:8].tolist(),
        "rounds_per_rank": counts[:8].tolist(),
        "growth": round(self.planner.growth_calibration(), 2),
        "chosen_factor": {"alone": self.chosen[True].factor, "shared": self.chosen[False].factor},
        "draft_ms": {"alone": ms(self.draft_seconds(True)), "shared": ms(self.draft_seconds(False))},
        "entry_ms": {"alone": ms(self.entry_seconds(True)), "shared": ms(self.entry_seconds(False))},
        "copy_ms": {"alone": ms(self.copy_seconds(True)), "shared": ms(self.copy_seconds(False))},
    }
    LOG.write(json.dumps(line) + "\n")


Planner.plan = plan_and_log
Planner.observe_generation = learn_and_log

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
