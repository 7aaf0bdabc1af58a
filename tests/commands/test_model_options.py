"""The options that pick what ``generate`` and ``serve`` load: a bad --budget is refused by the parser."""

from __future__ import annotations

import argparse

import pytest

from diffdraft.commands.model_options import add_model_arguments


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
