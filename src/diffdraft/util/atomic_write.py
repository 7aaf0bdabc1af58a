"""Write a small file so that a reader (or a run resumed after a kill) never sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` beside ``path`` under a name of this process, then rename it over ``path``:
    the rename is atomic, and two processes writing at once never share the temporary file."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.tmp{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)
