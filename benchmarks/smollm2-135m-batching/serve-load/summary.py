"""The serve-load table from run.sh's files: per method and client count, output tokens/s of the
median pass (of an even count, the mean of the middle two) and the requests' mean tau; beside it,
ddtree+pld:auto over `ar` pass by pass (the two ran back to back), median [lowest-highest], and their
mean with a 95% bootstrap interval (resampling the passes): whether a shortfall is more than the
machine's noise. Where the run has a fixed budget's server (ddtree+pld-<budget> files), also
ddtree+pld:auto over the better of `ar` and it by the median passes: issue 32's bar."""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METHODS = ("ar", "ddtree-auto", "ddtree+pld-auto")
FIXED = re.compile(r"ddtree\+pld-\d+")
"""A fixed budget's server, as run.sh names it."""


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
    fixed = sorted({method for method, _ in speed if FIXED.fullmatch(method)})
    methods = [*METHODS, *fixed]
    bar = " | over the better of ar and " + ", ".join(fixed) + " |" if fixed else " |"
    print("| clients | " + " | ".join(methods) + " | ddtree+pld:auto / ar | pass by pass | mean [95%]" + bar)
    print("|---|" + "---|" * (len(methods) + 3 + bool(fixed)))
    for clients in counts:
        median = {m: statistics.median(speed[m, clients].values()) for m in methods if (m, clients) in speed}
        mean_tau = {m: statistics.mean(tau[m, clients]) for m in median}
        cells = [f"{median[m]:.1f} (tau {mean_tau[m]:.2f})" if m in median else "-" for m in methods]
        reference, auto = speed["ar", clients], speed["ddtree+pld-auto", clients]
        ratio = median["ddtree+pld-auto"] / median["ar"]
        paired = [auto[run] / reference[run] for run in sorted(reference.keys() & auto.keys())]
        spread = f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]" if paired else "-"
        interval = _mean_interval(paired)
        better = max(median.get(m, 0.0) for m in ("ar", *fixed))
        against = f" {median['ddtree+pld-auto'] / better:.3f}x |" if fixed else ""
        print(f"| {clients} | " + " | ".join(cells) + f" | {ratio:.2f}x | {spread} | {interval} |" + against)
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
