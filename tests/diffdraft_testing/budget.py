"""Cost-model stand-ins for the budget planners: timings, rounds recorded as the engine records them, and a
planner for which drafting never pays."""

from __future__ import annotations

import torch

from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.budget.round_budget import RoundBudgetPlanner
from diffdraft.runtime.stats import GenerationStats


def slow_after_bigger_forwards():
    """A stand-in for timing one round (``(target, cache or caches, tokens) -> seconds``) on a machine
    whose one-token forward takes 4 ms right after a bigger one and comes down 1 ms a round to 1 ms
    in a run; a bigger forward takes 10 ms."""
    since_bigger = [0]

    def time_round(target, cache, tokens: torch.Tensor) -> float:
        if tokens.shape[0] > 1:
            since_bigger[0] = 0
            return 0.01
        since_bigger[0] += 1
        return 0.001 * max(1, 5 - since_bigger[0])

    return time_round


def losing_planner(explore_every: int = 4, explore_alone: int = 4) -> RoundBudgetPlanner:
    """Drafting never pays: the forward costs 10 ms plus 10 ms per extra token, drafting 20 ms."""
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.64]])
    rounds = RoundBudgetPlanner(
        BudgetPlanner(curve), explore_every=explore_every, explore_alone=explore_alone
    )
    rounds._draft_seconds.add(True, 0.02)
    return rounds


def drafted_once(plain_rounds: int) -> GenerationStats:
    """A sequence that drafted one round, then decoded ``plain_rounds`` rounds plainly."""
    surrogate = [1.0 + 0.3 * b for b in range(20)]
    return GenerationStats(surrogates=[surrogate], tree_sizes=[3] + [0] * plain_rounds)


def verified(
    stats: GenerationStats, nodes: int, accepted: list[int], context: int = 512, seconds: float = 0.0
) -> None:
    """Record a verified round in a sequence's stats, as the engine's commit does."""
    stats.rounds += 1
    stats.tree_sizes.append(nodes)
    stats.accepted_nodes.append(accepted)
    stats.verify_contexts.append(context)
    stats.verify_seconds.append(seconds)
    stats.verify_forwards.append((1, nodes + 1, context))
