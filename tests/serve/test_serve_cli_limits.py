"""``diffdraft serve``'s API key sources (flag, file, environment) and request limits: read and
checked before anything loads, and the key never shown."""

from __future__ import annotations

import argparse

import pytest

import diffdraft.commands.model_options
from diffdraft.cli import main
from diffdraft.errors import DiffdraftError
from diffdraft.serve.cli import add_serve_parser, api_key, server_limits
from diffdraft.serve.limits import ServerLimits


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *args])


@pytest.fixture
def no_load(monkeypatch):
    """Fails the command if it gets as far as loading a model."""

    def load(*args, **kwargs):
        raise AssertionError("the command loaded a model")

    monkeypatch.setattr(diffdraft.commands.model_options, "load", load)


def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFDRAFT_API_KEY", raising=False)
    assert api_key(parse()) is None
    monkeypatch.setenv("DIFFDRAFT_API_KEY", "from-env")
    assert api_key(parse()) == "from-env"
    assert api_key(parse("--api-key", "from-flag")) == "from-flag"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nsecond line ignored\n")
    assert api_key(parse("--api-key-file", str(key_file))) == "from-file"


def test_an_unusable_key_file_is_an_error_that_does_not_show_the_key(tmp_path):
    with pytest.raises(DiffdraftError, match="cannot read --api-key-file"):
        api_key(parse("--api-key-file", str(tmp_path / "missing")))
    blank = tmp_path / "blank"
    blank.write_text("\nsesame\n")
    with pytest.raises(DiffdraftError, match="has no key on its first line") as refused:
        api_key(parse("--api-key-file", str(blank)))
    assert "sesame" not in str(refused.value)


def test_the_flag_and_the_file_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--api-key", "a", "--api-key-file", str(tmp_path / "key"))
    assert "not allowed with argument" in capsys.readouterr().err


def test_limits_default_and_bad_ones_exit_2_before_loading(no_load, tmp_path, capsys):
    assert server_limits(parse()) == ServerLimits()
    assert server_limits(parse("--max-request-bytes", "100", "--max-tokens-cap", "7")) == ServerLimits(
        max_request_bytes=100, max_tokens_cap=7
    )
    assert main(["serve", "--max-tokens-cap", "0"]) == 2
    assert "--max-tokens-cap >= 1" in capsys.readouterr().err
    assert server_limits(parse("--header-timeout", "2.5")).header_timeout == 2.5
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout > 0" in capsys.readouterr().err
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read --api-key-file" in capsys.readouterr().err
