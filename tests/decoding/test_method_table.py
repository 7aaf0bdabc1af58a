"""The method table: every row is consistent with the families and tree rules it names."""

from __future__ import annotations

import pytest

from diffdraft.decoding.method_table import METHODS, Drafting, TreeRule, auto_budget_methods, method_named
from diffdraft.drafters.checkpoint import resolve_drafter_path
from diffdraft.drafters.families import FAMILIES
from diffdraft.errors import InvalidRequestError


def test_rows_are_keyed_by_their_names_and_name_families_that_exist():
    assert list(METHODS) == [
        "ar",
        "pld",
        "chain",
        "ddtree",
        "chain+pld",
        "ddtree+pld",
        "dart",
        "deer",
        "deer-tree",
    ]
    for name, method in METHODS.items():
        assert method.name == name
        assert method.family is None or method.family in FAMILIES
        assert method.family is None or method.drafting is Drafting.MODEL
        assert not method.lookup_boost or method.drafting is Drafting.MODEL
        resolve_drafter_path(method.shipped_drafter)  # a shipped name, installed


def test_only_ddtree_rows_take_the_auto_budget_and_default_to_it():
    assert auto_budget_methods() == ["ddtree", "ddtree+pld", "deer-tree"]
    for method in METHODS.values():
        assert (method.default_budget == "auto") == method.auto_budget == (method.tree is TreeRule.DDTREE)
    assert METHODS["dart"].default_budget == 32  # the DART paper's 59 verifies too much on a CPU


def test_an_unknown_name_is_a_clear_error_listing_the_methods():
    assert method_named("ddtree+pld") is METHODS["ddtree+pld"]
    with pytest.raises(InvalidRequestError, match="unknown method 'medusa'; choose one of ar, pld, chain"):
        method_named("medusa")
