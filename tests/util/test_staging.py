"""Staged directories: the new contents replace the old only once complete; nothing is left behind."""

from __future__ import annotations

import os

import pytest

from diffdraft.util.staging import staged_directory


def test_a_finished_write_replaces_the_old_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with staged_directory(out) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (out / "old.txt").exists()  # untouched until the write is complete
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_write_leaves_the_old_directory_and_no_temporary_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(out) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("killed")
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_output_gets_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        with staged_directory(tmp_path / "out") as tmp:
            (tmp / "new.txt").write_text("new")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
