"""Writing a directory all at once: into a temporary directory beside it, renamed into place at the
end, so a failed or interrupted write leaves nothing half-done and an old directory stays intact
until the new one is complete."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A fresh directory ``.NAME.tmp-*`` beside ``out`` to write into; when the block succeeds it
    replaces ``out``, and whatever happens it is gone afterwards."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not mkdtemp: its mode 0700 would become the output's
    try:
        yield tmp
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed last."""
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(old / out.name)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
