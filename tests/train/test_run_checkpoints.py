"""A run's checkpoints: what a kill leaves is skipped and removed, and a state file never runs code."""

from __future__ import annotations

import json

import pytest
import torch

from diffdraft.errors import CheckpointError
from diffdraft.train.run_checkpoints import (
    STATE_FILE,
    latest_checkpoint,
    load_training_state,
    remove_incomplete,
    saved_checkpoints,
    tokens_seen_at,
)

from diffdraft_testing.pickles import RunsCode


def write_checkpoint(path, step: int, state: object = None) -> None:
    """A checkpoint directory as the trainer leaves it (its drafter files stand in as config.json)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"step": step}))
    state = {"state": {"step": step, "tokens_seen": 10 * step}} if state is None else state
    torch.save(state, path / STATE_FILE)


def test_what_a_killed_writer_leaves_is_skipped_then_removed_in_one_line(tmp_path, capsys):
    write_checkpoint(tmp_path / "checkpoint-3", 3)
    write_checkpoint(tmp_path / "checkpoint-4.tmp", 4)  # an older writer's staging, once read as step "4.tmp"
    (tmp_path / "checkpoint-5").mkdir()  # no state file: never completed
    (tmp_path / "checkpoint-5" / "config.json").write_text("{}")
    for staging in (".checkpoint-6.tmp-0123abcd", ".final.tmp-0123abcd"):
        (tmp_path / staging).mkdir()
        (tmp_path / staging / STATE_FILE).write_bytes(b"PK\x03\x04 cut")
    (tmp_path / "checkpoint-notes.txt").write_text("the user's own")
    (tmp_path / "metrics.jsonl").write_text("")

    assert saved_checkpoints(tmp_path) == [tmp_path / "checkpoint-3"] == [latest_checkpoint(tmp_path)]
    removed = remove_incomplete(tmp_path)
    left = ".checkpoint-6.tmp-0123abcd, .final.tmp-0123abcd, checkpoint-4.tmp, checkpoint-5"
    assert sorted(p.name for p in removed) == left.split(", ")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"diffdraft train: removed {left} from {tmp_path}: left half-written")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-3",
        "checkpoint-notes.txt",
        "metrics.jsonl",
    ]
    assert tokens_seen_at(tmp_path / "checkpoint-3") == 30
    assert remove_incomplete(tmp_path) == [] and capsys.readouterr().err == ""


def test_a_state_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state": RunsCode(tmp_path / "proof")}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert (tmp_path / "proof").exists()  # the payload is real: an unchecked load runs it

    write_checkpoint(tmp_path / "checkpoint-2", 2, {"state": {"step": 2, "tokens_seen": RunsCode(marker)}})
    for read in (load_training_state, tokens_seen_at):
        with pytest.raises(CheckpointError, match=r"does not unpickle those \(they could run code\)") as info:
            read(tmp_path / "checkpoint-2")
        assert str(tmp_path / "checkpoint-2" / STATE_FILE) in str(info.value)
        assert "delete this checkpoint directory to resume from the one before it" in str(info.value)
    assert not marker.exists()


def test_a_damaged_state_is_named_with_the_fix(tmp_path):
    write_checkpoint(tmp_path / "checkpoint-2", 2)
    state = tmp_path / "checkpoint-2" / STATE_FILE
    state.write_bytes(state.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=f"{state} cannot be read .*delete this checkpoint directory"):
        load_training_state(tmp_path / "checkpoint-2")
