"""Resuming an interrupted benchmark: each finished prompt turn (every method, one repeat) is
appended to a journal in the output directory, and ``--resume`` replays it instead of generating
the turn again.

Timings from before and after an interruption only compare on the same machine under the same
settings, so the journal opens with a fingerprint of both and a resume under another one refuses.
The journal is deleted once the outputs are written: it exists only while a run is unfinished.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from diffdraft.bench.methods import Completion
from diffdraft.bench.records import Record, TurnKey
from diffdraft.errors import InvalidRequestError

JOURNAL = "journal.jsonl"


class Journal:
    def __init__(self, out_dir: str | os.PathLike, fingerprint: dict, resume: bool) -> None:
        self.path = Path(out_dir) / JOURNAL
        self.finished: dict[TurnKey, list[Record]] = {}
        lines = self.path.read_text().splitlines() if resume and self.path.is_file() else []
        started = _decode(lines[0]).get("fingerprint") if lines else None
        if started is None:  # nothing to resume: a new run
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
            return
        if started != fingerprint:
            changed = sorted(k for k in {*fingerprint, *started} if started.get(k) != fingerprint.get(k))
            raise InvalidRequestError(
                f"cannot resume the benchmark in {self.path.parent}: it was started with other settings or "
                f"on another machine ({', '.join(changed)} differ), so its timings would not compare; "
                "rerun with the original command on the original machine, or without --resume to start over"
            )
        kept = 1
        for line in lines[1:]:
            entries = _decode(line).get("records")
            if not entries:
                break  # the last line of a killed run may be cut short; that turn runs again
            records = [Record(**(e | {"completion": Completion(**e["completion"])})) for e in entries]
            self.finished[records[0].key] = records
            kept += 1
        self.path.write_text("".join(line + "\n" for line in lines[:kept]))  # drop a cut-short line

    def append(self, records: list[Record]) -> None:
        """Record one finished turn; on disk before the next turn starts."""
        with self.path.open("a") as handle:
            handle.write(json.dumps({"records": [asdict(r) for r in records]}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _decode(line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return {}
