"""The cache root: one variable moves everything diffdraft builds once per machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffdraft.util.cache import cache_root


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DIFFDRAFT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "diffdraft"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "diffdraft"
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
