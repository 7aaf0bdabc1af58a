"""The DDTree builder of budget 'auto': each round's budgets planned together, each tree built to its
sequence's share of the plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diffdraft.budget.batch_cost import BatchCostCurve
from diffdraft.budget.planner import BudgetPlanner, rounds_of, surrogate_acceptance
from diffdraft.budget.round_budget import RoundBudgetPlanner, plan_budgets
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees import DDTreeBuilder, DraftTree, RoundSequence, TreeRound


class AutoBudgetBuilder:
    """A DDTree builder whose budgets :meth:`plan` chooses for all sequences of a round together
    (:class:`~diffdraft.budget.round_budget.RoundBudgetPlanner`; 0: the sequence does not draft).

    Every ``refresh`` trees of a sequence it builds a tree ``lookahead`` times the sequence's budget
    once, records its surrogate in the sequence's stats (the acceptance the round planner expects
    from it comes from there), and verifies that tree's best-first prefix of the planned size plus
    ``explore_up`` of it on every other refresh, and minus ``explore_down`` of it on the rest: the
    bigger trees are how the planner measures the ranks just past its choice, and both are how it
    measures what a node costs around it. A smaller tree loses acceptance and a bigger one costs
    time, so the steps are small and taken on one tree in ``refresh``. Other trees are built at the
    planned budget directly, so the surrogate's cost is paid once in ``refresh`` trees.

    The builder itself holds settings and what finished sequences taught: a sequence's budgets,
    refresh rounds and surrogates live in its own :class:`~diffdraft.runtime.stats.GenerationStats`.
    """

    def __init__(
        self,
        planner: BudgetPlanner,
        initial_budget: int = 32,
        refresh: int = 8,
        lookahead: int = 4,
        explore_up: float = 0.5,
        explore_down: float = 0.25,
        batch_cost: BatchCostCurve | Callable[[], BatchCostCurve] | None = None,
    ) -> None:
        """``batch_cost``: what forwards shared by several sequences cost, or its loader (without it,
        the single-sequence curve over all their tokens stands in)."""
        self.planner = planner
        self.rounds = RoundBudgetPlanner(planner, batch_cost, refresh=refresh)
        self.initial_budget = initial_budget
        self.refresh = refresh
        self.lookahead = lookahead
        self.explore_up = explore_up
        self.explore_down = explore_down

    def plain_stands(self, sequences: int) -> bool:
        """Whether the last plan, all plain, stands (:meth:`RoundBudgetPlanner.plain_stands`)."""
        return self.rounds.plain_stands(sequences)

    def plan(self, sequences: Sequence[RoundSequence]) -> list[int]:
        """Each sequence's node budget this round (see :class:`RoundBudgetPlanner`)."""
        return self.rounds.plan(sequences)

    def plain_settled(self) -> bool:
        """Whether plain rounds settled in (:meth:`RoundBudgetPlanner.plain_settled`)."""
        return self.rounds.plain_settled()

    def copy_lengths(self, budgets: Sequence[int], copies: Sequence[Sequence[float] | None]) -> list[int]:
        """How many tokens of each offered free copy to verify
        (:meth:`RoundBudgetPlanner.copy_lengths`)."""
        return self.rounds.copy_lengths(budgets, copies)

    def build(self, tree_round: TreeRound) -> DraftTree:
        """The sequence's next tree, of the round's planned ``budget`` (None: its last budget, or the
        initial one); the budget and any surrogate are recorded in the round's ``stats`` (None: the
        first tree of a sequence nobody keeps a record of). The tree is :class:`DDTreeBuilder`'s over
        the round's ``root_token`` and ``proposal``; ``sampling``, ``generator`` and ``context`` are
        unused (the plan read the context)."""
        proposal = tree_round.proposal
        stats = tree_round.stats if tree_round.stats is not None else GenerationStats()
        budget, horizon = self._sizes(tree_round.budget, stats)
        built = len(stats.budgets)
        # DDTreeBuilder reads only the round's root and proposal: the same round serves it
        if horizon is None or not proposal.has_distributions:
            tree = DDTreeBuilder(budget).build(tree_round)
        else:
            largest, prefix_log_probs = DDTreeBuilder(horizon).ranked(tree_round)
            stats.surrogates.append(surrogate_acceptance(prefix_log_probs))
            if built // self.refresh % 2 == 0:
                verified = min(horizon, budget + max(1, round(self.explore_up * budget)))
            else:
                verified = max(1, budget - max(1, round(self.explore_down * budget)))
            keep = slice(0, verified + 1)  # best-first order: a prefix is the optimal smaller tree
            tree = DraftTree(largest.tokens[keep], largest.parents[keep], largest.depths[keep])
        stats.budgets.append(budget)
        return tree

    def deepest(self, budget: int | None, stats: GenerationStats | None) -> int:
        """The round's tree reaches no deeper than its node count: the planned budget, or on a
        refresh round the bigger tree its surrogate is read from."""
        budget, horizon = self._sizes(budget, stats if stats is not None else GenerationStats())
        return horizon or budget

    def _sizes(self, planned: int | None, stats: GenerationStats) -> tuple[int, int | None]:
        """(this tree's budget: the plan's, else the sequence's last, else the initial one; the
        bigger tree a refresh round builds first, None on other rounds). A sequence's first tree
        looks ahead from the initial budget only while no finished sequence taught the planner: after
        that, from the plan's budget (the 128-node first tree of the default initial budget cost every
        lone request several times as much, and gave the sequence a surrogate several times as long
        as its later ones to sum at every estimate; docs/decisions.md, "a first tree looks ahead from
        the plan's budget")."""
        if stats.budgets:
            previous = stats.budgets[-1]
        else:
            previous = planned if planned and self.planner.has_proposals else self.initial_budget
        budget = min(planned or previous, self.planner.max_budget)
        if len(stats.budgets) % self.refresh:
            return budget, None
        return budget, min(self.planner.max_budget, self.lookahead * max(previous, budget, 4))

    def observe_generation(self, stats: GenerationStats) -> None:
        """Teach the planners a finished sequence's own record (its surrogates, what each round
        accepted over which context, how long its forwards and stages took)."""
        for surrogate in stats.surrogates:
            self.planner.observe_proposal(surrogate)
        promised = self.planner.promised_gains(stats)
        self.planner.observe_rounds(rounds_of(stats), promised)
        self.rounds.observe_generation(stats)

    def describe(self, context: int) -> dict:
        """What the auto budget expects of a lone sequence over ``context`` cached tokens, for reports:
        its plan's budget (0: plain decoding) and, at every power-of-two budget, the expected
        acceptance and tokens per second, each costed as the round planner costs it (a drafting round
        pays the drafter's time, every round its commit; the finished rounds' estimate, as a sequence
        that has not drafted yet gets)."""
        taus = self.planner.expected_tau()
        verify, draft, commit = self.rounds.round_costs([taus], context)  # verify: by tokens
        [budget] = plan_budgets([taus], verify, draft, commit, [False])
        shown = [b for b in range(len(taus)) if b & (b - 1) == 0 or b == budget]
        sizes, scales, _ = self.planner.cost_scales()
        return {
            "context": context,
            "budget": budget,
            "growth_calibration": self.planner.growth_calibration(),
            "cost_scales": dict(zip(sizes, scales, strict=True)),
            "draft_ms": 1e3 * draft,
            "commit_ms": 1e3 * commit,
            "expected_tau": {b: taus[b] for b in shown},
            "expected_tokens_per_second": {
                b: taus[b] / (verify[b + 1] + draft * (b > 0) + commit) for b in shown
            },
        }
