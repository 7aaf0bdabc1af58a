"""The decoding methods, one row each: which drafter a method runs, whether prompt lookup boosts it,
which tree rule builds its trees and with what budget by default, and which drafter it gets with
the default target. The generator, the CLI and the benchmark read a method's row instead of parsing
its name, so a new method is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from diffdraft.drafters.deer_model import DEER
from diffdraft.errors import InvalidRequestError


class Drafting(Enum):
    """Where a method's drafts come from."""

    NONE = "none"
    """No drafts: plain decoding."""
    LOOKUP = "lookup"
    """Prompt lookup: the continuation of the latest earlier n-gram match, no model."""
    MODEL = "model"
    """A drafter checkpoint of any family (:mod:`diffdraft.drafters.families`)."""


class TreeRule(Enum):
    """How a round's tree is built from the drafter's proposal (:mod:`diffdraft.trees`)."""

    CHAIN = "chain"
    """The argmax chain (greedy) or a sampled chain; takes no budget."""
    DDTREE = "ddtree"
    """DDTree's best-first optimal tree of ``budget`` nodes, or ``"auto"``: the budget planned from
    this machine's measured verification cost."""
    DART = "dart"
    """DART's N-gram-pruned beam tree of ``budget`` nodes, over the N-gram trie given."""


@dataclass(frozen=True)
class Method:
    """One decoding method's row."""

    name: str
    drafting: Drafting
    tree: TreeRule = TreeRule.CHAIN
    lookup_boost: bool = False
    """Boost the drafter's proposal with prompt lookup's copied continuation (``+pld``,
    :mod:`diffdraft.drafters.lookup_boost`)."""
    family: str | None = None
    """The drafter family (its key) the method is the recipe of, and so takes only; None: any."""
    default_budget: int | str | None = None
    """The budget when none is given (None: the tree rule takes none)."""
    shipped_drafter: str = "default"
    """The drafter it gets with ``--target default`` and no ``--drafter``."""

    @property
    def auto_budget(self) -> bool:
        """Whether it takes ``budget="auto"``: only DDTree's budget is planned from measured costs."""
        return self.tree is TreeRule.DDTREE


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method("ar", Drafting.NONE),
        Method("pld", Drafting.LOOKUP),
        Method("chain", Drafting.MODEL),
        Method("ddtree", Drafting.MODEL, TreeRule.DDTREE, default_budget="auto"),
        Method("chain+pld", Drafting.MODEL, lookup_boost=True),
        Method("ddtree+pld", Drafting.MODEL, TreeRule.DDTREE, lookup_boost=True, default_budget="auto"),
        # the DART paper's 59 nodes verify too many tokens to pay on a CPU (the benchmark runs 59)
        Method("dart", Drafting.MODEL, TreeRule.DART, default_budget=32, shipped_drafter="default-dart"),
        # DEER's decoding (a chain verified by rejection sampling, its Eq. 5-6), and DDTree over it
        Method("deer", Drafting.MODEL, family=DEER, shipped_drafter="default-deer"),
        Method(
            "deer-tree",
            Drafting.MODEL,
            TreeRule.DDTREE,
            family=DEER,
            default_budget="auto",
            shipped_drafter="default-deer",
        ),
    )
}
"""Every method by name. Any drafter serves any tree rule; ``deer`` and ``deer-tree`` are DEER's
recipe and take DEER drafters only."""


def auto_budget_methods() -> list[str]:
    """The methods that take ``budget="auto"``, for messages."""
    return [name for name, method in METHODS.items() if method.auto_budget]


def method_named(name: str) -> Method:
    """The method of that name, or an :class:`~diffdraft.errors.InvalidRequestError` that lists them."""
    if name not in METHODS:
        raise InvalidRequestError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]
