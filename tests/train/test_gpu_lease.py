"""scripts/gpu_lease at CI size: payload parts per call put back byte for byte, the tree shrink and its
undo in a scratch repository, and the device helpers' arithmetic and export (never a GPU)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.target.loading import load_target
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import make_checkpoint, save_tiny_drafter

LEASE = Path(__file__).resolve().parents[2] / "scripts" / "gpu_lease"
KIB = 1024


@pytest.fixture
def lease(monkeypatch):
    """The lease scripts' modules (they import each other as plain modules, as when run as scripts)."""
    monkeypatch.syspath_prepend(str(LEASE))
    return {name: importlib.import_module(name) for name in ("payload", "stage", "device")}


def random_file(path: Path, size: int, seed: int) -> Path:
    data = torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    return path


def test_parts_split_over_calls_come_back_byte_identical(lease, tmp_path):
    payload = lease["payload"]
    files = {
        "small.whl": random_file(tmp_path / "a.whl", 3 * KIB, 0),
        "empty.txt": random_file(tmp_path / "empty", 0, 1),
        "target.gguf": random_file(tmp_path / "big.gguf", 2500 * KIB, 2),
    }
    capacity = payload.MIB  # the smallest allowed: the big file spans three calls
    planned = payload.plan_calls(files, capacity)
    carried = tmp_path / "staging"
    folders = payload.write_calls(files, planned, carried)
    assert len(folders) == 3
    for folder in folders:
        parts = [p for p in folder.iterdir() if p.name != payload.MANIFEST]
        assert sum(p.stat().st_size for p in parts) <= capacity
    store, dest = tmp_path / "store", tmp_path / "assembled"
    argv = ["--carried", str(carried), "--store", str(store)]
    assert payload.main(["receive", "1", *argv]) == payload.MORE_TO_COME
    assert payload.main(["receive", "2", *argv]) == payload.MORE_TO_COME
    with pytest.raises(SystemExit, match=r"call\(s\) \[3\] are not here"):
        payload.assemble(store, dest)
    assert payload.main(["receive", "3", *argv]) == 0
    assert payload.main(["assemble", str(dest), *argv]) == 0
    for name, original in files.items():
        assert (dest / name).read_bytes() == original.read_bytes()

    # a part damaged on the way fails its checksum; a call whose parts were lost is named
    part = next(store.glob("target.gguf.part-01"))
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="does not match its checksum"):
        payload.assemble(store, dest)
    payload.write_calls(files, planned, carried)
    with pytest.raises(SystemExit, match=r"call\(s\) \[1, 2\] are gone"):
        payload.main(["receive", "3", "--carried", str(carried), "--store", str(tmp_path / "cold")])
    with pytest.raises(ValueError, match="make the working tree smaller"):
        payload.plan_calls(files, payload.MIB - 1)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_shrink_tree_untracks_big_files_and_restore_puts_the_index_back(lease, tmp_path):
    stage = lease["stage"]
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "small.py").write_text("print('hi')\n")
    random_file(repo / "weights.bin", stage.BIG_FILE, 0)
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    (repo / "new.txt").write_text("untracked, not ignored: it travels too\n")
    assert set(stage.travelling_files(repo)) == {Path("small.py"), Path("weights.bin"), Path("new.txt")}

    assert stage.shrink_tree(repo) == [Path("weights.bin")]
    assert set(stage.travelling_files(repo)) == {Path("small.py"), Path("new.txt")}
    assert (repo / "weights.bin").is_file()  # only the index changed
    with pytest.raises(SystemExit, match="shrunk already"):
        stage.shrink_tree(repo)

    assert stage.restore_tree(repo) == [Path("weights.bin")]
    assert git(repo, "status", "--porcelain") == "?? new.txt\n"
    assert "weights.bin" not in (repo / ".git" / "info" / "exclude").read_text()
    assert stage.restore_tree(repo) == []


def test_the_printed_calls_carry_one_folder_each_the_last_trains_and_figures_follow(lease):
    stage = lease["stage"]
    folders = [stage.REPO / ".gpu_lease" / f"call-{k}" for k in (1, 2, 3)]
    lines = stage.run_calls(folders, 5)
    assert (
        lines[0]
        == 'run(command="bash scripts/gpu_lease/device.sh 1", carry=[".gpu_lease/call-1"], timeout_s=180)'
    )
    assert lines[2].startswith('run(command="LEASE_MINUTES=5 bash scripts/gpu_lease/device.sh 3"')
    assert lines[2].endswith("timeout_s=600)")
    assert lines[3] == 'run(command="bash scripts/gpu_lease/figures.sh", timeout_s=420)'


def test_wheels_must_be_there_once_each(lease, tmp_path):
    stage = lease["stage"]
    with pytest.raises(SystemExit, match="no wheel of transformers"):
        stage.find_wheels(tmp_path)
    for name in ("transformers-5.24.0", "gguf-0.19.0", "dflash-0.1.0"):
        (tmp_path / f"{name}-py3-none-any.whl").write_bytes(b"")
    assert [w.name.split("-")[0] for w in stage.find_wheels(tmp_path)] == ["transformers", "gguf", "dflash"]
    (tmp_path / "gguf-0.18.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(SystemExit, match="2 wheels"):
        stage.find_wheels(tmp_path)


def write_metrics(run: Path, steps: int, tokens_per_step: int, seconds_per_step: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "step": k,
            "tokens_seen": k * tokens_per_step,
            "elapsed_seconds": 5.0 + k * seconds_per_step,
            "loss": 1.0,
        }
        for k in range(1, steps + 1)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_steps_fit_the_minutes_at_the_probe_s_rate_and_the_summary_compares_evals(lease, tmp_path):
    device = lease["device"]
    probe, run, out = tmp_path / "probe", tmp_path / "run", tmp_path / "out"
    write_metrics(probe, 12, 1000, 0.01)  # 100 K tokens/s after the warm-up steps, 1000 tokens a step
    assert device.steps_for(probe, 1) == pytest.approx(device.SAFETY * 60 * 100, abs=1)
    write_metrics(run, 50, 1000, 0.02)
    out.mkdir()
    for name, first, tau in (("shipped", 0.5, 2.0), ("new", 0.6, 2.1)):
        evaluation = {"accuracy_by_position": [first, 0.3], "tau": {"chain": tau, "ddtree-8": tau + 0.3}}
        (out / f"eval-{name}.json").write_text(json.dumps(evaluation))
    result = device.summary(run, probe, out)
    assert result["tokens_per_second"] == pytest.approx(50_000)
    assert result["probe_tokens_per_second"] == pytest.approx(100_000)
    assert result["steps"] == 50 and result["tokens_seen"] == 50_000
    assert result["held_out"]["tau"]["chain"] == {"shipped": 2.0, "new": 2.1}
    assert result["new_is_better"]


def test_export_brings_back_the_latest_checkpoint_in_bfloat16(lease, tmp_path):
    device = lease["device"]
    run = tmp_path / "run"
    assert device.export(run, tmp_path / "out" / "drafter") is None
    drafter = save_tiny_drafter(make_checkpoint(tmp_path / "target"), run / "checkpoint-7")
    (drafter / "training_state.pt").write_bytes(b"")  # what makes a checkpoint complete
    out = tmp_path / "out" / "drafter"
    assert device.export(run, out) == "checkpoint-7"
    exported = load_draft_model(out)
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


@pytest.mark.real_model
def test_the_device_s_converted_target_has_the_tokenizer_packs_are_made_with(lease, tmp_path):
    from diffdraft.target.default_model import default_gguf_path

    lease["device"].convert(default_gguf_path(), tmp_path / "target")
    converted = load_target(tmp_path / "target", dtype="float32", device="cpu").tokenizer
    default = load_target("default", dtype="float32", device="cpu").tokenizer
    assert tokenizer_fingerprint(converted) == tokenizer_fingerprint(default)
