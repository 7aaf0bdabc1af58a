"""Held-out first-position accuracy and DDTree-32 tau of the shipped DFlare drafters against their
training tokens, with a log-linear fit extrapolated to issue 13's bars (accuracy 0.5, tau 3).

Reads the `train eval` results listed in benchmarks/drafter-ablation/scaling.json and writes
scaling.png next to it; prints the fitted gain per doubling of tokens and the tokens each bar needs.

    python scripts/plot_drafter_scaling.py benchmarks/drafter-ablation/scaling.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

BARS = {"accuracy 1": 0.5, "tau DDTree-32": 3.0}


def series(points: list[dict]) -> dict[str, list[float]]:
    return {
        "accuracy 1": [p["eval"]["accuracy_by_position"][0] for p in points],
        "tau DDTree-32": [p["eval"]["tau"]["ddtree-32"] for p in points],
    }


def main(path: str) -> None:
    spec = Path(path)
    points = json.loads(spec.read_text())["drafters"]
    tokens = np.array([p["tokens"] for p in points], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (name, values) in zip(axes, series(points).items(), strict=True):
        slope, intercept = np.polyfit(np.log2(tokens), values, 1)
        needed = 2 ** ((BARS[name] - intercept) / slope) if slope > 0 else math.inf
        print(f"{name}: +{slope:.3f} per doubling of tokens; {BARS[name]} needs ~{needed / 1e6:,.0f} M")
        grid = np.geomspace(tokens.min(), max(needed, tokens.max()) * 1.2 if slope > 0 else tokens.max(), 50)
        ax.plot(tokens / 1e6, values, "o", label="shipped drafters (held-out, float32)")
        for point, value in zip(points, values, strict=True):
            where = (point["tokens"] / 1e6, value)
            ax.annotate(point["name"], where, textcoords="offset points", xytext=(4, -10))
        fit = slope * np.log2(grid) + intercept
        ax.plot(grid / 1e6, fit, "--", label=f"log-linear fit: +{slope:.3f} / doubling")
        ax.axhline(BARS[name], color="grey", lw=0.8, label=f"issue 13 bar ({BARS[name]})")
        ax.set(xscale="log", xlabel="training tokens (M)", ylabel=name, title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(spec.with_name("scaling.png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
