"""Files too big for one device call, split over several calls and put back together there.

A `run` call carries the working tree plus at most 64 MiB in all, and a lent machine keeps what a
call left in /tmp only while it stays warm between calls. So the payload (the target GGUF, the
packed data, wheels, the drafter's weights) is cut into parts, one folder per call, each folder
holding the whole plan (``manifest.json``); on the device every call moves its parts out of the
carried folder, and the last one reassembles each file and checks its SHA-256. Standard library
only: it runs on the bare device before any wheel is installed.

Device use (``scripts/gpu_lease/device.sh`` calls these):

    python3 scripts/gpu_lease/payload.py receive CALL     # this call's parts into the store
    python3 scripts/gpu_lease/payload.py assemble DEST    # every file, checked, into DEST
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
STAGING = Path(".gpu_lease")
"""The git-ignored folder the staging writes (``call-1``, ``call-2``, ...), relative to the repo."""
STORE = Path("/tmp/diffdraft-lease/parts")
"""Where the device keeps the parts received so far (outside the repo: a later call's carry
replaces carried paths)."""
MIB = 1 << 20
MORE_TO_COME = 10
"""``receive``'s exit status while later calls still have parts to bring."""
_BLOCK = 8 * MIB


@dataclass
class Part:
    call: int
    name: str
    size: int


@dataclass
class PayloadFile:
    name: str
    """File name on the device (in the assembled folder)."""
    size: int
    sha256: str
    parts: list[Part] = field(default_factory=list)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def plan_calls(files: dict[str, Path], capacity: int) -> list[PayloadFile]:
    """Fill calls of ``capacity`` bytes in order with ``files`` (name on the device -> local path),
    splitting a file where a call is full."""
    if capacity < MIB:
        raise ValueError(
            f"each call has only {capacity} bytes left for the payload; make the working tree smaller"
        )
    planned, call, room = [], 1, capacity
    for name, path in files.items():
        size = path.stat().st_size
        item = PayloadFile(name, size, sha256_of(path))
        left = size
        while left > 0 or not item.parts:
            if room == 0:
                call, room = call + 1, capacity
            take = min(left, room)
            item.parts.append(Part(call, f"{name}.part-{len(item.parts):02d}", take))
            left -= take
            room -= take
        planned.append(item)
    return planned


def write_calls(files: dict[str, Path], planned: list[PayloadFile], out: Path) -> list[Path]:
    """Write each call's parts and the manifest into ``out/call-K``; returns the call folders."""
    shutil.rmtree(out, ignore_errors=True)
    calls = max(part.call for item in planned for part in item.parts)
    folders = [out / f"call-{k}" for k in range(1, calls + 1)]
    for folder in folders:
        folder.mkdir(parents=True)
    for path, item in zip(files.values(), planned, strict=True):
        with path.open("rb") as source:
            for part in item.parts:
                with (out / f"call-{part.call}" / part.name).open("wb") as target:
                    _copy(source, target, part.size)
    manifest = json.dumps({"calls": calls, "files": [asdict(item) for item in planned]}, indent=1)
    for folder in folders:
        (folder / MANIFEST).write_text(manifest + "\n")
    return folders


def read_manifest(folder: Path) -> tuple[int, list[PayloadFile]]:
    data = json.loads((folder / MANIFEST).read_text())
    files = [
        PayloadFile(f["name"], f["size"], f["sha256"], [Part(**p) for p in f["parts"]]) for f in data["files"]
    ]
    return data["calls"], files


def receive(call: int, carried: Path, store: Path) -> list[int]:
    """Move call ``call``'s parts from the carried folder into ``store``; returns the calls whose
    parts are still missing there."""
    source = carried / f"call-{call}"
    if not (source / MANIFEST).is_file():
        raise SystemExit(f"payload: {source} has no {MANIFEST}; carry {source} in this call (see stage.py)")
    store.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        shutil.move(str(path), store / path.name)
    return missing_calls(store)


def missing_calls(store: Path) -> list[int]:
    _, planned = read_manifest(store)
    return sorted({part.call for item in planned for part in item.parts if not (store / part.name).is_file()})


def assemble(store: Path, dest: Path) -> list[Path]:
    """Every payload file rebuilt from its parts into ``dest``, each checked against its SHA-256."""
    missing = missing_calls(store)
    if missing:
        raise SystemExit(
            f"payload: the parts of call(s) {missing} are not here (the machine went cold between calls "
            "and lost them?); run those calls again, then this one"
        )
    _, planned = read_manifest(store)
    dest.mkdir(parents=True, exist_ok=True)
    built = []
    for item in planned:
        path = dest / item.name
        with path.open("wb") as target:
            for part in item.parts:
                with (store / part.name).open("rb") as source:
                    shutil.copyfileobj(source, target, _BLOCK)
        if path.stat().st_size != item.size or sha256_of(path) != item.sha256:
            raise SystemExit(f"payload: {item.name} does not match its checksum; stage and carry it again")
        built.append(path)
    return built


def _copy(source, target, size: int) -> None:
    while size > 0:
        block = source.read(min(size, _BLOCK))
        target.write(block)
        size -= len(block)


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    steps = parser.add_subparsers(dest="step", required=True)
    got = steps.add_parser("receive", help="move this call's carried parts into the store")
    got.add_argument("call", type=int)
    built = steps.add_parser("assemble", help="rebuild and check every payload file")
    built.add_argument("dest", type=Path)
    for step in (got, built):
        step.add_argument("--carried", type=Path, default=STAGING, help="default: %(default)s")
        step.add_argument("--store", type=Path, default=STORE, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.step == "receive":
        missing = receive(args.call, args.carried, args.store)
        lost = [call for call in missing if call < args.call]
        if lost:
            raise SystemExit(
                f"payload: the parts of call(s) {lost} are gone (the machine went cold between calls); "
                "run every call again from the first"
            )
        if missing:
            print(f"payload: call {args.call} received; calls still to come: {missing}", flush=True)
            return MORE_TO_COME
        print(f"payload: call {args.call} received; every part is here", flush=True)
    else:
        for path in assemble(args.store, args.dest):
            print(f"payload: {path} ({path.stat().st_size / MIB:.1f} MiB, checksum ok)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
