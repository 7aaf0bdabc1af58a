"""``diffdraft generate`` on a tiny checkpoint: JSON output, chat from stdin, streaming, clear errors."""

from __future__ import annotations

import io
import json

import pytest

import diffdraft.commands.model_options
from diffdraft.cli import main
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.errors import CheckpointError
from diffdraft.target.loading import load_target
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_drafter


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
    assert "logprobs" not in out


def test_json_output_takes_log_probabilities_when_asked(checkpoint, capsys):
    args = ["generate", "--target", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "5"]
    assert main([*args, "--json", "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["token_id"] for t in out["logprobs"]] == out["token_ids"]
    assert all(t["logprob"] <= 0 and len(t["top"]) == 2 for t in out["logprobs"])


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
        (["--logprobs", "2"], "add --json"),
        (["--logprobs", "30", "--json"], "logprobs must be None or the number"),
        (["--cuda-graphs", "--device", "cpu"], "cuda_graphs needs a CUDA target"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(checkpoint, capsys, args, message):
    assert main(["generate", "--target", str(checkpoint), "--prompt", "hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_target_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def drafters(checkpoint, tmp_path_factory):
    """(DFlash drafter, DEER drafter) directories for the tiny target."""
    loaded = load_target(checkpoint)
    root = tmp_path_factory.mktemp("drafters")
    save_draft_model(tiny_drafter(loaded.model, block_size=4).float(), root / "dflash")
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    save_draft_model(deer_from_causal_lm(loaded.model, 1, 4, 0, fingerprint, "tiny target"), root / "deer")
    return root / "dflash", root / "deer"


@pytest.mark.parametrize("method", ["deer", "deer-tree"])
def test_deer_methods_run_with_a_deer_drafter(checkpoint, drafters, capsys, method):
    args = ["generate", "--target", str(checkpoint), "--drafter", str(drafters[1]), "--method", method]
    assert main([*args, "--budget", "6", "--prompt", "hello world", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8 and out["rounds"] >= 1


@pytest.mark.parametrize("method", ["deer", "deer-tree"])
def test_deer_methods_with_another_drafter_family_exit_2_writing_nothing(
    checkpoint, drafters, capsys, method
):
    args = ["generate", "--target", str(checkpoint), "--drafter", str(drafters[0]), "--method", method]
    assert main([*args, "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"method '{method}' needs a DEER drafter" in captured.err
    assert "use --method chain or ddtree" in captured.err


@pytest.mark.parametrize(
    ("target", "method", "drafter"),
    [
        ("default", "deer", "default-deer"),
        ("default", "deer-tree", "default-deer"),
        ("default", "dart", "default-dart"),
        ("default", "ddtree", "default"),
        ("elsewhere", "deer", "none"),
    ],
)
def test_the_default_drafter_follows_the_method(monkeypatch, capsys, target, method, drafter):
    asked = {}

    def load(target, drafter, method, *rest):
        asked.update(target=target, drafter=drafter, method=method)
        raise CheckpointError(f"the {drafter} drafter is missing from this installation")

    monkeypatch.setattr(diffdraft.commands.model_options, "load", load)
    assert main(["generate", "--target", target, "--method", method, "--prompt", "hi"]) == 2
    assert asked == {"target": target, "drafter": drafter, "method": method}
    assert capsys.readouterr().out == ""


def test_a_gguf_cut_to_100_bytes_is_one_line_naming_the_file_and_the_fix(tmp_path, capsys):
    from diffdraft.target.default_model import default_gguf_path

    cut = tmp_path / "model.gguf"
    with default_gguf_path().open("rb") as whole:
        cut.write_bytes(whole.read(100))
    assert main(["generate", "--target", str(cut), "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"diffdraft: error: {cut} is truncated or damaged")
    assert captured.err.count("\n") == 1 and "download it again" in captured.err


def test_a_prompt_of_bytes_that_are_not_utf8_is_a_clear_error_and_utf8_text_generates(checkpoint, capsys):
    args = ["generate", "--target", str(checkpoint), "--max-new-tokens", "3", "--json"]
    assert main([*args, "--prompt", "hello \udcff"]) == 2  # how Python hands over argv byte 0xff
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "prompt is not valid UTF-8 text: it has a byte that is not UTF-8 (0xff" in captured.err
    assert main([*args, "--prompt", "hello wörld"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_chat_on_stdin_that_is_not_utf8_is_a_clear_error(checkpoint, capsys, monkeypatch):
    messages = json.dumps([{"role": "user", "content": "hi"}]).encode()
    strict = io.TextIOWrapper(io.BytesIO(messages[:-2] + b"\xff" + messages[-2:]), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", strict)
    assert main(["generate", "--target", str(checkpoint), "--chat"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"byte 0xff at offset {len(messages) - 2} of what it read is not UTF-8" in captured.err
    escaped = json.dumps([{"role": "user", "content": "hi \udcff"}])  # a surrogateescape stdin's reading
    monkeypatch.setattr("sys.stdin", io.StringIO(escaped))
    assert main(["generate", "--target", str(checkpoint), "--chat"]) == 2
    assert "messages[0]['content'] is not valid UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "1e-300"], "temperature 1e-300 is too small to sample with: use 0 for greedy"),
        (["--temperature", "nan"], "temperature must be a number, got nan"),
        (["--temperature", "inf"], "temperature must be finite"),
        (["--temperature=-1e-300"], "temperature must be >= 0"),
        (["--temperature", "0.7", "--top-p", "1.5"], r"top_p must be in (0, 1]"),
    ],
)
def test_degenerate_sampling_exits_2_before_loading_and_a_sound_temperature_samples(
    checkpoint, capsys, monkeypatch, args, message
):
    def load(*given):
        raise AssertionError("loaded a target for a request that was refused")

    with monkeypatch.context() as patched:
        patched.setattr(diffdraft.commands.model_options, "load", load)
        assert main(["generate", "--target", str(checkpoint), "--prompt", "hi", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    sampled = ["--temperature", "0.01", "--seed", "3", "--max-new-tokens", "4", "--json"]
    assert main(["generate", "--target", str(checkpoint), "--prompt", "hi", *sampled]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


@pytest.mark.parametrize("method", ["ddtree", "dart"])
def test_a_budget_above_the_tree_bound_exits_2_before_loading_anything(monkeypatch, capsys, method):
    def load(*given):
        raise AssertionError("loaded a target for a budget that was refused")

    monkeypatch.setattr(diffdraft.commands.model_options, "load", load)
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--method", method, "--budget", "1000000000", "--prompt", "hi"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "argument --budget: at most 4096 nodes" in captured.err
