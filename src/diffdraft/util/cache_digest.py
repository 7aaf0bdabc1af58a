"""Nothing in diffdraft's cache is trusted blindly: every entry records what its bytes were when written,
and a reader checks them before using any.

An entry is a directory (the converted default target, a GGUF's layout, an N-gram trie) or a single
file (a compiled kernel, a cost curve, a dense GGUF). Its manifest lists each file's size and digest and
is written last: inside a directory entry, as it is staged, so the manifest appears with the directory's
rename; beside a file entry, once the file is in place. An entry without a manifest is a write that did
not finish (or an older diffdraft's), a size or digest that differs is damage on disk: either way the
reader says what was wrong in one line and rebuilds the entry, never uses it.

Digests are xxh3-128: a bad bit, a cut or a stray write in any byte changes it, and it hashes several
times faster than sha256 or blake2b, which matters because the default target's 540 MB are checked on
every load (docs/decisions.md, "Cache entries checked by their digest"). It guards against accidents,
not an attacker who can write the cache (and rewrite the manifest with it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from diffdraft.util.atomic_write import write_text_atomically
from diffdraft.util.staging import staged_directory

MANIFEST = "manifest.json"
"""A directory entry's manifest; a file entry's is ``NAME.manifest`` beside it (not ``*.json``, so a
folder of cached curves still globs as one ``.json`` a curve)."""
ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20
"""Bytes hashed per read: large enough that the per-call cost vanishes, small next to the files."""


@contextmanager
def sealed_directory(out: Path) -> Iterator[Path]:
    """A staging directory to write the entry ``out`` into; when the block succeeds, its manifest is
    written and it replaces ``out`` (:func:`diffdraft.util.staging.staged_directory`)."""
    with staged_directory(out) as staging:
        yield staging
        seal(staging)


@contextmanager
def sealed_file(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out`` to write the entry into; when the block succeeds, it is renamed
    over ``out`` and ``out``'s manifest written after it (a kill between leaves a file without one:
    rebuilt). Whatever happens the temporary file is gone afterwards."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        yield temporary
        os.replace(temporary, out)
        seal(out)
    finally:
        temporary.unlink(missing_ok=True)


def seal(entry: Path) -> None:
    """Write the manifest of ``entry``: a directory's lists every file under it, a file's that file."""
    files = _files(entry) if entry.is_dir() else {entry.name: entry}
    listed = {name: {"size": path.stat().st_size, "digest": digest(path)} for name, path in files.items()}
    manifest = {"algorithm": ALGORITHM, "files": listed}
    write_text_atomically(manifest_path(entry), json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def intact(entry: Path, what: str, remedy: str) -> bool:
    """Whether ``entry`` holds what its manifest records. A missing entry is silently not intact (the
    caller builds it as on first use); a damaged or half-written one is reported on stderr in one line
    ("diffdraft: WHAT at ENTRY failed its check (PROBLEM); REMEDY")."""
    if not entry.exists() and not manifest_path(entry).exists():
        return False
    found = problem(entry)
    if found is None:
        return True
    print(f"diffdraft: {what} at {entry} failed its check ({found}); {remedy}", file=sys.stderr)
    return False


def problem(entry: Path) -> str | None:
    """What is wrong with ``entry`` in a few words, or None when every file its manifest lists is there
    with its size and digest (and a directory holds no other). Sizes are compared before any byte is
    hashed, so a truncated file costs nothing to find."""
    try:
        manifest = json.loads(manifest_path(entry).read_text())
        listed: dict[str, dict] = manifest["files"]
        if manifest["algorithm"] != ALGORITHM:
            return f"its manifest uses {manifest['algorithm']}, not {ALGORITHM}"
    except FileNotFoundError:
        return "no manifest: its write did not finish, or an older diffdraft wrote it"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest: {error}"
    base = entry if entry.is_dir() else entry.parent
    if entry.is_dir():
        unlisted = sorted(set(_files(entry)) - set(listed))
        if unlisted:
            return f"{unlisted[0]} is not in its manifest"
    for name, recorded in listed.items():
        path = base / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded["size"]:
            return f"{name} is {size} bytes, {recorded['size']} when written"
    for name, recorded in listed.items():
        if digest(base / name) != recorded["digest"]:
            return f"{name} digest mismatch"
    return None


def digest(path: Path) -> str:
    """``path``'s xxh3-128 digest in hex, read in chunks (a file of gigabytes needs no more memory)."""
    hasher = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while read := file.readinto(buffer):
            hasher.update(view[:read])
    return hasher.hexdigest()


def manifest_path(entry: Path) -> Path:
    """Where ``entry``'s manifest lies: inside a directory, beside anything else."""
    return entry / MANIFEST if entry.is_dir() else entry.with_name(f"{entry.name}.manifest")


def _files(directory: Path) -> dict[str, Path]:
    """Every file under ``directory`` but its manifest, by path relative to it."""
    files = {path.relative_to(directory).as_posix(): path for path in directory.rglob("*") if path.is_file()}
    files.pop(MANIFEST, None)
    return files
