"""``diffdraft serve-load`` against a live tiny server: throughput, latency and first-token numbers,
failures counted, and URLs off this machine refused."""

from __future__ import annotations

import json
import socket

import pytest

import diffdraft
from diffdraft.cli import main
from diffdraft.errors import DiffdraftError
from diffdraft.serve.load import LoadSettings, check_url, format_report, percentile, read_prompts, run_load

from diffdraft_testing.serving import make_chat_checkpoint, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_chat_checkpoint(tmp_path_factory.mktemp("target"))
    with serving(diffdraft.load(checkpoint, method="pld"), "tiny", max_batch_size=4) as live:
        yield live


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://127.8.9.10", "http://localhost:1/x", "http://[::1]:80"]
)
def test_loopback_urls_are_allowed(url):
    check_url(url, allow_remote=False)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.5:8000", "http://192.168.1.1", "https://example.com", "http://0.0.0.0"]
)
def test_other_urls_are_refused_unless_allowed(url):
    with pytest.raises(DiffdraftError, match="not a loopback address"):
        check_url(url, allow_remote=False)
    check_url(url, allow_remote=True)


def test_a_url_without_a_host_is_refused():
    with pytest.raises(DiffdraftError, match="must look like"):
        check_url("127.0.0.1:8000", allow_remote=False)


def test_prompt_files_take_strings_prompts_and_chats(tmp_path):
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    path.write_text(f'"plain"\n\n{{"prompt": "p", "id": 3}}\n{json.dumps({"messages": chat})}\n')
    assert read_prompts(path) == [{"prompt": "plain"}, {"prompt": "p"}, {"messages": chat}]
    path.write_text('{"text": "x"}\n')
    with pytest.raises(DiffdraftError, match=":1: expected"):
        read_prompts(path)
    path.write_text("not json\n")
    with pytest.raises(DiffdraftError, match="is not JSON"):
        read_prompts(path)


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 50) == 10 and percentile(values, 95) == 19 and percentile(values, 100) == 20
    assert percentile([], 50) is None


@pytest.mark.parametrize(("endpoint", "stream"), [("chat", False), ("completions", True)])
def test_a_load_run_reports_throughput_and_latency(server, endpoint, stream):
    settings = LoadSettings(
        url=server.url,
        endpoint=endpoint,
        concurrency=3,
        requests=7,
        max_tokens=5,
        ignore_eos=True,
        stream=stream,
    )
    report = run_load(settings)
    summary = report.summary()
    assert report.succeeded and summary["succeeded"] == 7 and summary["failed"] == 0
    assert summary["completion_tokens"] == 35
    assert summary["requests_per_second"] > 0 and summary["output_tokens_per_second"] > 0
    assert 0 < summary["latency_p50"] <= summary["latency_p95"]
    assert summary["mean_tau"] >= 1
    if stream:
        assert 0 < summary["ttft_p50"] <= summary["ttft_p95"]
    else:
        assert summary["ttft_p50"] is None
    assert report.settings["model"] == "tiny"
    table = format_report(report)
    assert "requests/s" in table and "7 ok, 0 failed" in table


def test_the_command_prints_a_table_and_writes_json(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    args = ["serve-load", "--url", server.url, "--requests", "4", "--concurrency", "2", "--max-tokens", "3"]
    assert main([*args, "--stream", "--json", str(out)]) == 0
    assert "first token p50 / p95" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["summary"]["succeeded"] == 4 and len(written["samples"]) == 4
    assert written["settings"]["concurrency"] == 2


def test_failed_requests_are_counted_and_fail_the_command(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("hello world " * 200) + "\n" + json.dumps("hello") + "\n")
    args = ["serve-load", "--url", server.url, "--requests", "4", "--concurrency", "2", "--max-tokens", "2"]
    assert main([*args, "--endpoint", "completions", "--prompts", str(prompts)]) == 1
    out = capsys.readouterr().out
    assert "2 ok, 2 failed" in out and "{'400': 2}" in out and "context holds 128" in out


def test_the_api_key_is_sent_from_the_flag_or_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DIFFDRAFT_API_KEY", raising=False)
    checkpoint = make_chat_checkpoint(tmp_path / "target")
    with serving(diffdraft.load(checkpoint, method="pld"), "tiny", api_key="sesame") as live:
        args = ["serve-load", "--url", live.url, "--requests", "2", "--concurrency", "1", "--max-tokens", "2"]
        assert main(args) == 2
        assert "GET /v1/models answered 401" in capsys.readouterr().err
        assert main([*args, "--api-key", "sesame"]) == 0
        monkeypatch.setenv("DIFFDRAFT_API_KEY", "sesame")
        assert main(args) == 0
        assert "2 ok, 0 failed" in capsys.readouterr().out


def test_a_remote_url_is_refused_before_anything_is_sent(capsys):
    assert main(["serve-load", "--url", "http://10.1.2.3:8000"]) == 2
    assert "not a loopback address" in capsys.readouterr().err


def test_no_server_at_the_url_is_a_clear_error(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve-load", "--url", f"http://127.0.0.1:{port}", "--requests", "1"]) == 2
    assert "no OpenAI-compatible server answered" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value"), [("--concurrency", "0"), ("--requests", "0"), ("--duration", "0")]
)
def test_bad_bounds_are_refused(option, value, capsys):
    assert main(["serve-load", option, value]) == 2
    assert option in capsys.readouterr().err
