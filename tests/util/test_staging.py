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


def test_a_durable_write_syncs_every_file_and_the_directories_before_and_after_the_rename(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    with staged_directory(out, durable=True) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("a")
        (tmp / "b.txt").write_text("b")
    names = [os.path.relpath(path, tmp) for path in synced[:-1]]
    assert sorted(names[:-1]) == ["b.txt", "sub", os.path.join("sub", "a.txt")] and names[-1] == "."
    assert names.index(os.path.join("sub", "a.txt")) < names.index("sub")  # a file before its folder
    assert synced[-1] == str(tmp_path)  # the rename reaches the disk too
    assert (out / "sub" / "a.txt").read_text() == "a"
    synced.clear()
    with staged_directory(out) as tmp:
        (tmp / "c.txt").write_text("c")
    assert synced == []  # the default stays as fast as it was
