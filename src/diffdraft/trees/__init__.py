"""Draft trees and the builders that turn a drafter's proposal into one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees.chain import ChainBuilder
from diffdraft.trees.ddtree import DDTreeBuilder
from diffdraft.trees.round import RoundSequence, TreeRound
from diffdraft.trees.tree import DraftTree

__all__ = [
    "ChainBuilder",
    "DDTreeBuilder",
    "DepthBoundedBuilder",
    "DraftTree",
    "RoundPlanner",
    "RoundSequence",
    "TreeBuilder",
    "TreeRound",
]


@runtime_checkable
class TreeBuilder(Protocol):
    """Decides which tokens the target verifies this round; the engine knows only this call."""

    def build(self, tree_round: TreeRound) -> DraftTree:
        """A tree rooted at ``tree_round.root_token`` covering at most ``tree_round.proposal.depth``
        positions, to be verified over ``tree_round.context`` cached tokens; each builder says which
        of the round's fields it reads."""
        ...


@runtime_checkable
class DepthBoundedBuilder(Protocol):
    """A tree builder that knows, before the drafter runs, how deep its tree can reach: the drafter
    then proposes only those positions (its forward and head grow with them; at batch 1 a block
    drafted to budget 4 instead of 7 made a DDTree round faster at equal acceptance,
    docs/decisions.md, "a small budget drafts only the positions it reaches")."""

    def deepest(self, budget: int | None, stats: GenerationStats | None) -> int:
        """The deepest position this round's tree can use, given the round plan's ``budget`` (None:
        the builder's own size) and the sequence's record (None: nobody keeps one)."""
        ...


@runtime_checkable
class RoundPlanner(Protocol):
    """A tree builder that sizes the trees of all sequences sharing a round's verification forward
    together, before they draft: budget 0 means the sequence does not draft this round and verifies
    its pending token alone (plain decoding), or with the free copy :meth:`copy_lengths` gives it."""

    def plain_stands(self, sequences: int) -> bool:
        """Asked first every round, with the number of sequences in it: True when the last plan, which
        left its batch plain, stands this round too (the round then plans nothing and copies nothing:
        under load most rounds are such, and asking costs far less than planning)."""
        ...

    def plan(self, sequences: Sequence[RoundSequence]) -> list[int]:
        """One node budget per sequence, in order (when :meth:`plain_stands` said no)."""
        ...

    def plain_settled(self) -> bool:
        """Whether plans have given no sequence a tree for long: the drafter is then unlikely to draft
        soon, and a round without one need not tap the target's states for it."""
        ...

    def copy_lengths(self, budgets: Sequence[int], copies: Sequence[Sequence[float] | None]) -> list[int]:
        """After :meth:`plan`, for the round it planned: how many tokens of each sequence's free
        copy (a drafter's copied continuation that costs no drafting: prompt lookup's) to verify, 0
        where none pays; ``copies[i]``: the expected acceptance length per copied length (None:
        none offered). Only a sequence the plan gave budget 0 takes one. It may be asked again with
        other copies (first the most any copy could expect, to skip looking for one that cannot
        pay): the round's last answer is what it verifies."""
        ...

    def build(self, tree_round: TreeRound) -> DraftTree:
        """:meth:`TreeBuilder.build` of a tree of about ``tree_round.budget`` nodes (the plan's)."""
        ...
