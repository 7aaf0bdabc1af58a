"""The serve-load table from run.sh's files: per method and client count, output tokens/s of the
median pass (of an even count, the mean of the middle two) and the requests' mean tau; beside it,
ddtree+pld:auto over `ar` pass by pass (the two ran back to back), median [lowest-highest], and their
mean with a 95% bootstrap interval (resampling the passes): whether a shortfall is more than the
machine's noise."""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METHODS = ("ar", "ddtree-auto", "ddtree+pld-auto")


def main(folder: Path) -> None:
    speed: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    """Output tokens/s by (method, clients), then by pass."""
    tau: dict[tuple[str, int], list[float]] = defaultdict(list)
    failed = 0
    for file in sorted(folder.glob("*-c*-p*.json")):
        method, clients, run = re.fullmatch(r"(.+)-c(\d+)-p(\d+)\.json", file.name).groups()
        summary = json.loads(file.read_text())["summary"]
        speed[method, int(clients)][int(run)] = summary["output_tokens_per_second"]
        tau[method, int(clients)].append(summary["mean_tau"])
        failed += summary["failed"]
    counts = sorted({clients for _, clients in speed})
    print("| clients | " + " | ".join(METHODS) + " | ddtree+pld:auto / ar | pass by pass | mean [95%] |")
    print("|---|" + "---|" * (len(METHODS) + 3))
    for clients in counts:
        cells = [
            f"{statistics.median(speed[m, clients].values()):.1f}"
            f" (tau {statistics.mean(tau[m, clients]):.2f})"
            for m in METHODS
        ]
        reference, auto = speed["ar", clients], speed["ddtree+pld-auto", clients]
        ratio = statistics.median(auto.values()) / statistics.median(reference.values())
        paired = [auto[run] / reference[run] for run in sorted(reference.keys() & auto.keys())]
        spread = f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]" if paired else "-"
        interval = _mean_interval(paired)
        print(f"| {clients} | " + " | ".join(cells) + f" | {ratio:.2f}x | {spread} | {interval} |")
    runs = sum(len(v) for v in speed.values())
    passes = sorted({len(v) for v in speed.values()})
    print(f"\n{runs} runs, passes per point {passes}, failed requests {failed}")


def _mean_interval(paired: list[float], resamples: int = 4000) -> str:
    """The mean of the paired ratios and its 95% percentile bootstrap interval (fixed seed)."""
    if len(paired) < 2:
        return "-"
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(paired, k=len(paired))) for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return f"{statistics.fmean(paired):.3f}x [{low:.3f}-{high:.3f}]"


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
