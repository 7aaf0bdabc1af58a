"""Writing an export directory all at once: into a temporary directory beside ``--out``, renamed into
place at the end, so a refused or failed export leaves nothing behind and an old one stays intact."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

from safetensors.torch import save_file

from diffdraft.errors import InvalidRequestError
from diffdraft.export.layout import Export

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse a file, or a non-empty directory without ``force``, before any work is done."""
    if out.exists() and not out.is_dir():
        raise InvalidRequestError(f"--out {out} is a file; pass a directory path for the exported drafter")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InvalidRequestError(
            f"--out {out} is not empty; choose another --out, or pass --force to replace its contents"
        )


def write_export(export: Export, out: Path) -> None:
    """``config.json`` + ``model.safetensors`` in ``out``; an existing ``out`` is replaced last."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not mkdtemp: its mode 0700 would become the export's
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(export.config, indent=2, sort_keys=True) + "\n")
        save_file(export.weights, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
