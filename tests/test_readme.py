"""The README cannot drift from the command line: every ``diffdraft`` command in its code blocks parses
with the CLI's own parser, and the quick start's command runs as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from diffdraft.cli import build_parser, main

README = Path(__file__).resolve().parent.parent / "README.md"
USAGE = re.compile(r"\[[^\]]*\||\bPATH\|")
"""A usage synopsis (``[--target PATH|default]``), not a command to run."""


def readme_commands() -> list[list[str]]:
    """The arguments of every ``diffdraft`` command in the README's code blocks: continued lines
    joined, comments dropped, each command of an ``&&`` chain on its own."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if part.strip().startswith("diffdraft ") and not USAGE.search(part):
                    commands.append(shlex.split(part, comments=True)[1:])
    return commands


def test_the_readme_has_commands_to_check():
    names = {words[0] for words in readme_commands()}
    assert {"generate", "train", "bench", "serve", "export"} <= names


@pytest.mark.parametrize("words", readme_commands(), ids=lambda words: " ".join(words)[:60])
def test_every_readme_command_parses_with_the_cli(words):
    build_parser().parse_args(words)  # argparse exits (SystemExit 2) on anything it does not take


@pytest.mark.real_model
def test_the_quick_start_command_runs_as_written(capsys):
    quick_start = next(words for words in readme_commands() if words[:1] == ["generate"])
    assert main(quick_start) == 0
    assert "tokens" in capsys.readouterr().err
