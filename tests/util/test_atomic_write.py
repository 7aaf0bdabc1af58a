"""A small file is replaced whole or not at all, and no temporary file is left behind."""

from __future__ import annotations

import pytest

from diffdraft.util.atomic_write import write_text_atomically


def test_the_file_is_replaced_and_nothing_else_is_left(tmp_path):
    target = tmp_path / "index.json"
    target.write_text("old")
    write_text_atomically(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "curve.json"
    target.write_text("old")

    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomically(target, "new")
    assert target.read_text() == "old"
