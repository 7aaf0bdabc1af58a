"""Writing an export directory all at once: into a temporary directory beside ``--out``, renamed into
place at the end, so a refused or failed export leaves nothing behind and an old one stays intact."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from diffdraft.errors import InvalidRequestError
from diffdraft.export.layout import Export
from diffdraft.util.staging import staged_directory

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
    with staged_directory(out) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(export.config, indent=2, sort_keys=True) + "\n")
        save_file(export.weights, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
