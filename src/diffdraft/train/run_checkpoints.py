"""A training run's checkpoints: written whole, found complete, cleaned up after a kill, and read
without running code.

``checkpoint-<step>/`` holds the drafter (``config.json``, ``model.safetensors``) and
:data:`STATE_FILE`: the optimizer's and scheduler's state dicts, the step, tokens and time counted so
far and the config, nothing but tensors and plain values. A checkpoint, like ``final/``, is written
into a staging directory beside it, synced to disk and renamed into place
(:func:`~diffdraft.util.staging.staged_directory`), so whenever a kill lands, a name is either a
complete checkpoint or absent. What the kill leaves besides (the staging directory; from diffdraft
before this layout, a ``checkpoint-<step>.tmp`` folder, which every resume once took for a
checkpoint and crashed on) and any ``checkpoint-*`` folder without its state file is incomplete:
:func:`remove_incomplete` deletes it on resume and says so in one line.

:func:`load_training_state` reads the state with ``weights_only=True``: a run directory from
elsewhere whose state file is a pickle that would run code is refused with a
:class:`~diffdraft.errors.CheckpointError`, never executed.
"""

from __future__ import annotations

import pickle
import re
import shutil
import sys
from pathlib import Path

import torch

from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.families import DraftModel
from diffdraft.errors import CheckpointError
from diffdraft.util.staging import staged_directory

STATE_FILE = "training_state.pt"
"""Written last into a checkpoint's staging directory: a ``checkpoint-<step>`` without it is
incomplete."""
FINAL = "final"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_LEFT = re.compile(r"checkpoint-\d+(\.tmp)?")
"""The names of incomplete checkpoints :func:`remove_incomplete` deletes: a user's other files stay."""
_STAGING = (".checkpoint-*.tmp-*", ".checkpoint-*.old-*", f".{FINAL}.tmp-*", f".{FINAL}.old-*")
"""What :func:`~diffdraft.util.staging.staged_directory` leaves when killed mid-write or mid-rename."""


def saved_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete ``checkpoint-<step>`` directories of a run, by step."""
    complete = [p for p in Path(output_dir).glob("checkpoint-*") if _is_complete(p)]
    return sorted(complete, key=_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint of the highest step, or None."""
    checkpoints = saved_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete what an interrupted run left half-written in ``output_dir`` (see the module docstring),
    saying so in one stderr line; the paths removed. Only the process that writes checkpoints may
    call it (rank 0), before it trains."""
    output_dir = Path(output_dir)
    left = [p for p in output_dir.glob("checkpoint-*") if _LEFT.fullmatch(p.name) and not _is_complete(p)]
    left += [p for pattern in _STAGING for p in output_dir.glob(pattern)]
    if not left:
        return []
    for path in left:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as error:
            raise CheckpointError(
                f"cannot remove {path}, left half-written by an interrupted run ({error}); remove it by hand "
                "and run again"
            ) from error
    names = ", ".join(sorted(p.name for p in left))
    print(
        f"diffdraft train: removed {names} from {output_dir}: left half-written by an interrupted run "
        f"(a checkpoint is complete once its {STATE_FILE} is in place)",
        file=sys.stderr,
    )
    return left


def save_checkpoint(path: Path, drafter: DraftModel, state: dict) -> None:
    """Write ``checkpoint-<step>`` (or any drafter directory with a training state) whole: the drafter
    in its family's layout, then ``state`` (tensors and plain values only), synced and renamed in."""
    with staged_directory(path, durable=True) as staging:
        save_draft_model(drafter, staging)
        torch.save(state, staging / STATE_FILE)


def save_final(output_dir: Path, drafter: DraftModel) -> Path:
    """Write the finished drafter to ``output_dir/final`` whole, synced and renamed in."""
    final = output_dir / FINAL
    with staged_directory(final, durable=True) as staging:
        save_draft_model(drafter, staging)
    return final


def load_training_state(checkpoint: Path, mmap: bool = False) -> dict:
    """A checkpoint's training state, read with ``weights_only=True`` (``mmap``: tensors stay on disk
    until touched). A file holding any other object, which unpickling could have let run code, or a
    damaged one, is a :class:`CheckpointError` naming it and the fix."""
    path = checkpoint / STATE_FILE
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds Python objects besides tensors and plain values; diffdraft does not unpickle "
            "those (they could run code) and wrote none. Use a checkpoint that `diffdraft train fit` "
            "wrote, or delete this checkpoint directory to resume from the one before it"
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointError(
            f"{path} cannot be read ({str(error).splitlines()[0]}); delete this checkpoint directory to "
            "resume from the one before it"
        ) from error


def tokens_seen_at(checkpoint: Path) -> int:
    """Training tokens the run had consumed when ``checkpoint`` was written (memory-mapped: the
    optimizer state in the same file is never read)."""
    return int(load_training_state(checkpoint, mmap=True)["state"]["tokens_seen"])


def _step(path: Path) -> int | None:
    match = _CHECKPOINT.fullmatch(path.name)
    return int(match[1]) if match else None


def _is_complete(path: Path) -> bool:
    return _step(path) is not None and path.is_dir() and (path / STATE_FILE).is_file()
