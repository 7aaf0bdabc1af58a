"""Writing a directory all at once: into a temporary directory beside it, renamed into place at the
end, so a failed or interrupted write leaves nothing half-done and an old directory stays intact
until the new one is complete."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(out: Path, durable: bool = False) -> Iterator[Path]:
    """A fresh directory ``.NAME.tmp-*`` beside ``out`` to write into; when the block succeeds it
    replaces ``out``, and whatever happens it is gone afterwards.

    A killed process never leaves ``out`` half written, since the kernel still writes out what the
    process wrote. ``durable`` also holds across a crash of the machine: every file is synced to disk
    before the rename and the rename itself after it, so ``out`` never names a directory whose files
    did not reach the disk. For what costs hours to make again (training checkpoints); a cache or an
    export is cheaper to redo than to wait for."""
    tmp = temp_dir_beside(out)
    try:
        yield tmp
        if durable:
            _sync_tree(tmp)
        move_into_place(tmp, out)
        if durable:
            _sync(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, ``root`` last."""
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        _sync(path)
    _sync(root)


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def temp_dir_beside(out: Path) -> Path:
    """A new empty directory ``.NAME.tmp-XXXXXXXX`` beside ``out`` (its parent made if missing), with
    the umask's mode: mkdtemp's 0700 would become ``out``'s once it is renamed into place, hiding a
    shared cache from other users."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        return tmp


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed last (also one
    that another process put there after the check: the first rename then fails)."""
    if not out.exists():
        try:
            tmp.rename(out)
            return
        except OSError:
            pass
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old / out.name)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
