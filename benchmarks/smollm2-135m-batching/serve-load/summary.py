"""The serve-load table from run.sh's files: per method and client count, output tokens/s of the
median pass (of an even count, the mean of the middle two) and the requests' mean tau; beside it,
ddtree+pld:auto over `ar` pass by pass (the two ran back to back), median [lowest-highest], and their
mean with a 95% bootstrap interval (resampling the passes): whether a shortfall is more than the
machine's noise. Where the run has a fixed budget's server (ddtree+pld-<budget> files), also
ddtree+pld:auto over the better of `ar` and it by the median passes: issue 32's bar.

``python summary.py [FOLDER] [--plot PNG]``: ``--plot`` also draws the medians against the client
count, and ddtree+pld:auto's ratio to `ar` pass by pass (median and range, the table's column) and
to the better of `ar` and the fixed budget beside the 0.97 bar. ``--pack`` then moves run.sh's
files into one ``runs.tar.gz`` (what a committed folder keeps: one file, not hundreds), which later
summaries read in their place."""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import re
import statistics
import tarfile
from collections import defaultdict
from pathlib import Path

METHODS = ("ar", "ddtree-auto", "ddtree+pld-auto")
FIXED = re.compile(r"ddtree\+pld-\d+")
"""A fixed budget's server, as run.sh names it."""
BAR = 0.97
"""Issue 32's bar: ddtree+pld:auto over the better of `ar` and the fixed budget."""
Speeds = dict[tuple[str, int], dict[int, float]]
"""Output tokens/s by (method, clients), then by pass."""
PACKED = "runs.tar.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(__file__).parent)
    parser.add_argument("--plot", type=Path, help="also draw the medians and ratios to this PNG")
    parser.add_argument("--pack", action="store_true", help=f"then move run.sh's files into {PACKED}")
    args = parser.parse_args()
    speed, tau, failed = _read(args.folder)
    counts = sorted({clients for _, clients in speed})
    fixed = sorted({method for method, _ in speed if FIXED.fullmatch(method)})
    methods = [*METHODS, *fixed]
    median = {key: statistics.median(passes.values()) for key, passes in speed.items()}
    bar = " | over the better of ar and " + ", ".join(fixed) + " |" if fixed else " |"
    print("| clients | " + " | ".join(methods) + " | ddtree+pld:auto / ar | pass by pass | mean [95%]" + bar)
    print("|---|" + "---|" * (len(methods) + 3 + bool(fixed)))
    for clients in counts:
        cells = [
            f"{median[m, clients]:.1f} (tau {statistics.mean(tau[m, clients]):.2f})"
            if (m, clients) in median
            else "-"
            for m in methods
        ]
        ratio = median["ddtree+pld-auto", clients] / median["ar", clients]
        paired = _paired(speed, clients)
        spread = f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]" if paired else "-"
        against = f" {_over_better(median, fixed, clients):.3f}x |" if fixed else ""
        print(
            f"| {clients} | "
            + " | ".join(cells)
            + f" | {ratio:.2f}x | {spread} | {_mean_interval(paired)} |"
            + against
        )
    runs = sum(len(v) for v in speed.values())
    passes = sorted({len(v) for v in speed.values()})
    print(f"\n{runs} runs, passes per point {passes}, failed requests {failed}")
    if args.plot is not None:
        _plot(speed, median, methods, fixed, counts, args.plot)
        print(f"wrote {args.plot}")
    if args.pack:
        _pack(args.folder)
        print(f"packed {runs} runs into {args.folder / PACKED}")


def _runs(folder: Path) -> dict[str, bytes]:
    """run.sh's files by name: from ``runs.tar.gz`` where the folder was packed, else the files."""
    packed = folder / PACKED
    if packed.is_file():
        with tarfile.open(packed) as archive:
            return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    return {file.name: file.read_bytes() for file in folder.glob("*-c*-p*.json")}


def _pack(folder: Path) -> None:
    """Move run.sh's files into ``runs.tar.gz`` (sorted, no timestamps: the same runs pack the same)."""
    files = sorted(folder.glob("*-c*-p*.json"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for file in files:
            data = file.read_bytes()
            member = tarfile.TarInfo(file.name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    (folder / PACKED).write_bytes(gzip.compress(buffer.getvalue(), mtime=0))
    for file in files:
        file.unlink()


def _read(folder: Path) -> tuple[Speeds, dict[tuple[str, int], list[float]], int]:
    """Output tokens/s; the requests' mean tau by (method, clients), a list over the passes; the
    failed requests in all."""
    speed: Speeds = defaultdict(dict)
    tau: dict[tuple[str, int], list[float]] = defaultdict(list)
    failed = 0
    for name, data in sorted(_runs(folder).items()):
        method, clients, run = re.fullmatch(r"(.+)-c(\d+)-p(\d+)\.json", name).groups()
        summary = json.loads(data)["summary"]
        speed[method, int(clients)][int(run)] = summary["output_tokens_per_second"]
        tau[method, int(clients)].append(summary["mean_tau"])
        failed += summary["failed"]
    return speed, tau, failed


def _paired(speed: Speeds, clients: int) -> list[float]:
    """ddtree+pld:auto over `ar` in each pass both ran."""
    reference, auto = speed["ar", clients], speed["ddtree+pld-auto", clients]
    return [auto[run] / reference[run] for run in sorted(reference.keys() & auto.keys())]


def _over_better(median: dict[tuple[str, int], float], fixed: list[str], clients: int) -> float:
    """ddtree+pld:auto over the better of `ar` and the fixed budgets, by the median passes."""
    better = max(median.get((m, clients), 0.0) for m in ("ar", *fixed))
    return median["ddtree+pld-auto", clients] / better


def _mean_interval(paired: list[float], resamples: int = 4000) -> str:
    """The mean of the paired ratios and its 95% percentile bootstrap interval (fixed seed)."""
    if len(paired) < 2:
        return "-"
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(paired, k=len(paired))) for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return f"{statistics.fmean(paired):.3f}x [{low:.3f}-{high:.3f}]"


def _plot(
    speed: Speeds,
    median: dict[tuple[str, int], float],
    methods: list[str],
    fixed: list[str],
    counts: list[int],
    path: Path,
) -> None:
    """Left: each server's median output tokens/s per client count. Right: ddtree+pld:auto over `ar`
    pass by pass (the median paired pass, bars to the lowest and highest) and over the better of `ar`
    and the fixed budget by the median passes, against the 0.97 bar."""
    import matplotlib

    matplotlib.use("Agg")  # a file only: no display where benchmarks run
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        shown = [c for c in counts if (method, c) in median]
        left.plot(shown, [median[method, c] for c in shown], marker="o", label=method.replace("-", ":", 1))
    left.set(xlabel="concurrent clients", ylabel="output tokens/s (median pass)", title="Server throughput")
    left.legend()
    paired = [_paired(speed, c) for c in counts]
    middle = [statistics.median(p) for p in paired]
    below = [m - min(p) for m, p in zip(middle, paired, strict=True)]
    above = [max(p) - m for m, p in zip(middle, paired, strict=True)]
    right.errorbar(counts, middle, yerr=[below, above], marker="o", capsize=3, label="over ar, pass by pass")
    if fixed:
        right.plot(
            counts,
            [_over_better(median, fixed, c) for c in counts],
            marker="s",
            label="over the better of ar and " + ", ".join(fixed),
        )
    right.axhline(BAR, color="grey", linestyle="--", label=f"{BAR} bar")
    right.set(xlabel="concurrent clients", ylabel="ratio", title="ddtree+pld:auto")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
