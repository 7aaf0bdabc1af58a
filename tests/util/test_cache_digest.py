"""Cache entries sealed with their digests: any damaged, missing, extra or half-written file is named."""

from __future__ import annotations

import pytest

from diffdraft.util.cache_digest import intact, manifest_path, problem, sealed_directory, sealed_file


def _entry(tmp_path):
    entry = tmp_path / "entry"
    with sealed_directory(entry) as staging:
        (staging / "weights.bin").write_bytes(bytes(range(256)) * 64)
        (staging / "sub").mkdir()
        (staging / "sub" / "config.json").write_text("{}")
    return entry


def test_a_sealed_directory_is_intact_and_says_nothing(tmp_path, capsys):
    entry = _entry(tmp_path)
    assert problem(entry) is None
    assert intact(entry, "the entry", "rebuilding it")
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # no staging folder left


def test_a_missing_entry_is_rebuilt_silently(tmp_path, capsys):
    assert not intact(tmp_path / "never-written", "the entry", "rebuilding it")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        (lambda e: _flip(e / "weights.bin", 5000), "weights.bin digest mismatch"),
        (lambda e: _cut(e / "weights.bin"), "weights.bin is 100 bytes, 16384 when written"),
        (lambda e: (e / "sub" / "config.json").unlink(), "sub/config.json is missing"),
        (lambda e: (e / "stray.bin").write_bytes(b"x"), "stray.bin is not in its manifest"),
        (lambda e: (e / "manifest.json").unlink(), "no manifest: its write did not finish"),
        (lambda e: (e / "manifest.json").write_text("{"), "unreadable manifest"),
    ],
)
def test_every_kind_of_damage_is_reported_in_one_line(tmp_path, capsys, damage, found):
    entry = _entry(tmp_path)
    damage(entry)
    assert not intact(entry, "the entry", "rebuilding it")
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"diffdraft: the entry at {entry} failed its check (")
    assert found in line and line.endswith("); rebuilding it")


def test_a_sealed_file_carries_its_manifest_beside_it(tmp_path, capsys):
    out = tmp_path / "curve.json"
    with sealed_file(out) as written:
        written.write_text('{"seconds": [1]}')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.json", "curve.json.manifest"]
    assert intact(out, "the curve", "measuring it again")
    out.write_text('{"seconds": [2]}')  # same size, other bytes
    assert not intact(out, "the curve", "measuring it again")
    assert "curve.json digest mismatch" in capsys.readouterr().err


def test_a_file_write_that_dies_leaves_nothing_and_one_without_manifest_is_not_intact(tmp_path, capsys):
    out = tmp_path / "library.so"
    with pytest.raises(KeyboardInterrupt), sealed_file(out) as written:
        written.write_bytes(b"half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    out.write_bytes(b"renamed into place, killed before its manifest")
    assert not manifest_path(out).exists()
    assert not intact(out, "the library", "compiling it again")
    assert "no manifest" in capsys.readouterr().err


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut(path):
    path.write_bytes(path.read_bytes()[:100])
