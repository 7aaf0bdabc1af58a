"""The options that pick what ``generate`` and ``serve`` load: a bad --budget is refused by the parser."""

from __future__ import annotations

import argparse

import pytest

from diffdraft.commands.model_options import add_model_arguments
from diffdraft.trees.tree import MAX_TREE_NODES


@pytest.mark.parametrize(("value", "budget"), [("auto", "auto"), ("6", 6)])
def test_a_budget_is_a_positive_integer_or_auto(value, budget):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args(["--budget", value]).budget == budget


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5"])
def test_a_bad_budget_names_the_accepted_forms(capsys, value):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--budget", value])
    assert exited.value.code == 2
    assert (
        f"argument --budget: expected a positive integer or 'auto', got '{value}'" in capsys.readouterr().err
    )


def test_a_budget_above_the_tree_bound_is_refused_with_the_reason_and_the_bound_itself_is_taken(capsys):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args(["--budget", str(MAX_TREE_NODES)]).budget == MAX_TREE_NODES
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--budget", "1000000000"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --budget: at most {MAX_TREE_NODES} nodes (a larger tree costs more to verify" in err
    assert "got '1000000000'" in err
