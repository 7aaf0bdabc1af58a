"""Stage a lent GPU's training run: payload parts per call, and the exact `run` calls to make.

Run here, before the lease (see README.md beside this file):

    python scripts/gpu_lease/stage.py --shrink-tree      # once: big tracked files stop travelling
    python scripts/gpu_lease/stage.py --data train.safetensors
    ... the printed `run` calls ...
    python scripts/gpu_lease/stage.py --restore          # before anyone commits

Every call carries the whole working tree (tracked and untracked-but-not-ignored files) plus its
carried paths, 64 MiB in all. The shipped DEER and DART weights and the benchmarks' large JSON files
alone are over that, so ``--shrink-tree`` takes every tracked file of 1 MiB or more out of the git
index (``git rm --cached``; the files stay on disk) and ignores them in ``.git/info/exclude``; the
one the device needs, the default drafter's weights, then travels once as payload. ``--restore``
puts the index entries back from HEAD and drops the exclude lines. Never commit in between: the
commit would delete those files.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from payload import MIB, STAGING, plan_calls, write_calls

REPO = Path(__file__).resolve().parents[2]
CALL_LIMIT = 64 * MIB
BIG_FILE = MIB
DRAFTER_WEIGHTS = Path("src/diffdraft/default_drafter/model.safetensors")
# names on the device; device.sh reads these
DRAFTER_NAME, DATA_NAME, TARGET_NAME = "default-drafter.safetensors", "train.safetensors", "target.gguf"
WHEELS = ("transformers", "gguf", "dflash")
"""Wheels the device lacks (it has torch): their dependencies are on the device image already; dflash
is the official package the synthetic round benchmark times beside ours."""
UNTRACKED_RECORD = Path(".git") / "diffdraft-lease-untracked.txt"
EXCLUDE = Path(".git") / "info" / "exclude"
EXCLUDE_BEGIN = "# >>> diffdraft gpu lease: untracked while staging (stage.py --restore removes this)"
EXCLUDE_END = "# <<< diffdraft gpu lease"
WHEEL_DOWNLOAD = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
    "--platform manylinux_2_28_x86_64 -d .whl {name}=={version}"
)


def git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def travelling_files(repo: Path = REPO) -> dict[Path, int]:
    """What a call copies besides its carried paths: tracked and untracked-not-ignored files."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", repo=repo).split("\0")
    sizes = {}
    for name in filter(None, listed):
        path = repo / name
        if path.is_file():
            sizes[Path(name)] = path.stat().st_size
    return sizes


def shrink_tree(repo: Path = REPO) -> list[Path]:
    """Untrack every tracked file of ``BIG_FILE`` bytes or more; returns them (recorded for restore)."""
    record = repo / UNTRACKED_RECORD
    if record.is_file():
        raise SystemExit(f"stage: the tree is shrunk already ({record}); --restore first to redo it")
    tracked = [Path(name) for name in filter(None, git("ls-files", "-z", repo=repo).split("\0"))]
    big = sorted(p for p in tracked if (repo / p).is_file() and (repo / p).stat().st_size >= BIG_FILE)
    if not big:
        return []
    record.write_text("".join(f"{path}\n" for path in big))
    git("rm", "--cached", "--quiet", "--", *map(str, big), repo=repo)
    exclude = repo / EXCLUDE
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as handle:
        handle.write("\n".join([EXCLUDE_BEGIN, *(f"/{path}" for path in big), EXCLUDE_END]) + "\n")
    return big


def restore_tree(repo: Path = REPO) -> list[Path]:
    """Undo :func:`shrink_tree`: index entries back from HEAD, exclude lines gone."""
    record = repo / UNTRACKED_RECORD
    if not record.is_file():
        return []
    paths = [Path(line) for line in record.read_text().splitlines() if line]
    git("reset", "--quiet", "--", *map(str, paths), repo=repo)
    exclude = repo / EXCLUDE
    if exclude.is_file():
        lines, kept, inside = exclude.read_text().splitlines(), [], False
        for line in lines:
            if line == EXCLUDE_BEGIN:
                inside = True
            elif line == EXCLUDE_END:
                inside = False
            elif not inside:
                kept.append(line)
        exclude.write_text("".join(f"{line}\n" for line in kept))
    record.unlink()
    return paths


def find_wheels(folder: Path) -> list[Path]:
    """One wheel of each package in ``WHEELS``; two versions of one would stop the install there."""
    found = []
    for name in WHEELS:
        wheels = sorted(folder.glob(f"{name}-*.whl"))
        if len(wheels) != 1:
            version = _installed_version(name)
            listed = ", ".join(wheel.name for wheel in wheels)
            problem = f"{len(wheels)} wheels ({listed})" if wheels else "no wheel"
            raise SystemExit(
                f"stage: {problem} of {name} in {folder}; keep exactly one, e.g.\n  "
                + WHEEL_DOWNLOAD.format(name=name, version=version)
            )
        found.append(wheels[0])
    return found


def _installed_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def run_calls(folders: list[Path], minutes: float) -> list[str]:
    """The `run` tool calls, one per folder, the last of them training and evaluating; then one
    carrying nothing that measures the GPU figures (figures.sh)."""
    lines = []
    for number, folder in enumerate(folders, start=1):
        last = number == len(folders)
        command = f"bash scripts/gpu_lease/device.sh {number}"
        if last:
            command = f"LEASE_MINUTES={minutes:g} {command}"
        timeout = 600 if last else 180
        lines.append(f'run(command="{command}", carry=["{folder.relative_to(REPO)}"], timeout_s={timeout})')
    lines.append('run(command="bash scripts/gpu_lease/figures.sh", timeout_s=420)')
    return lines


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--data", type=Path, help="packed training data (`diffdraft train pack`)")
    parser.add_argument("--gguf", type=Path, default=None, help="target GGUF (default: the default target's)")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="default: %(default)s")
    parser.add_argument(
        "--minutes", type=float, default=5.0, help="training minutes in the last call (default: %(default)s)"
    )
    parser.add_argument(
        "--margin-mib", type=float, default=1.0, help="room left in each call (default: %(default)s)"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--shrink-tree", action="store_true", help="untrack big files so calls carry less")
    group.add_argument("--restore", action="store_true", help="undo --shrink-tree")
    args = parser.parse_args(argv)
    if args.restore:
        paths = restore_tree()
        print(f"stage: {len(paths)} files tracked again" if paths else "stage: nothing to restore")
        return 0
    if args.shrink_tree:
        for path in shrink_tree():
            print(f"stage: untracked {path} (restore with --restore before any commit)")
    if args.data is None:
        return 0
    if not args.data.is_file():
        raise SystemExit(f"stage: {args.data} does not exist; make it with `diffdraft train pack` first")
    if args.gguf is None:
        from diffdraft.target.default_model import default_gguf_path

        args.gguf = default_gguf_path()
    tree = travelling_files()
    tree_bytes = sum(tree.values())
    payload = {wheel.name: wheel for wheel in find_wheels(args.wheels)}
    if DRAFTER_WEIGHTS not in tree:
        payload[DRAFTER_NAME] = REPO / DRAFTER_WEIGHTS
    payload |= {DATA_NAME: args.data, TARGET_NAME: args.gguf}
    for path in payload.values():
        inside = path.resolve().is_relative_to(REPO) and path.resolve().relative_to(REPO) in tree
        if inside and path != REPO / DRAFTER_WEIGHTS:
            raise SystemExit(
                f"stage: {path} travels with the working tree already, in every call; ignore it "
                f"(echo /{path.resolve().relative_to(REPO).parts[0]}/ >> .git/info/exclude) or move it"
            )
    capacity = CALL_LIMIT - tree_bytes - int(args.margin_mib * MIB)
    if capacity < 8 * MIB:
        biggest = sorted(tree.items(), key=lambda item: -item[1])[:5]
        listing = ", ".join(f"{path} {size / MIB:.1f} MiB" for path, size in biggest)
        raise SystemExit(
            f"stage: the working tree alone travels at {tree_bytes / MIB:.1f} MiB in every call (largest: "
            f"{listing}); run with --shrink-tree first"
        )
    planned = plan_calls(payload, capacity)
    folders = write_calls(payload, planned, REPO / STAGING)
    print(f"stage: working tree {tree_bytes / MIB:.1f} MiB per call, payload room {capacity / MIB:.1f} MiB")
    for item in planned:
        calls = sorted({part.call for part in item.parts})
        print(f"  {item.name}: {item.size / MIB:.1f} MiB in call(s) {calls}")
    print(f"stage: {len(folders)} calls, back to back (a machine idle 30 s is given back, parts and all):")
    for line in run_calls(folders, args.minutes):
        print(f"  {line}")
    print("stage: afterwards, before any commit: python scripts/gpu_lease/stage.py --restore")
    return 0


if __name__ == "__main__":
    sys.exit(main())
