"""``diffdraft generate`` on a tiny checkpoint: JSON output, chat from stdin, streaming, clear errors."""

from __future__ import annotations

import io
import json

import pytest

from diffdraft.cli import main

from conftest import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama")


def test_json_output_has_ids_text_and_stats(checkpoint, capsys):
    code = main(
        [
            "generate",
            "--target",
            str(checkpoint),
            "--method",
            "pld",
            "--prompt",
            "hello world",
            "--max-new-tokens",
            "8",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"prompt_token_ids", "token_ids", "text", "tau", "rounds", "timings"} <= set(out)
    assert 1 <= len(out["token_ids"]) <= 8


def test_chat_reads_messages_from_stdin(checkpoint, capsys, monkeypatch):
    # the tiny tokenizer has no chat template: the CLI must say so, not crash
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([{"role": "user", "content": "hi"}])))
    assert main(["generate", "--target", str(checkpoint), "--chat"]) == 2
    assert "chat template" in capsys.readouterr().err


def test_malformed_chat_json_is_a_clear_error(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("[{role: user}]"))
    assert main(["generate", "--target", str(checkpoint), "--chat"]) == 2
    assert "JSON list of messages" in capsys.readouterr().err


def test_stream_prints_the_text_and_a_stats_line(checkpoint, capsys):
    code = main(
        ["generate", "--target", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "6", "--stream"]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "tokens" in captured.err and "tau" in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p"),
        (["--method", "ddtree"], "needs a drafter"),
        (["--drafter", "/nonexistent", "--method", "chain"], "does not exist"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(checkpoint, capsys, args, message):
    assert main(["generate", "--target", str(checkpoint), "--prompt", "hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_target_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
