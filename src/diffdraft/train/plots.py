"""Training curves as PNGs: loss, per-position accuracy and held-out tau against tokens seen."""

from __future__ import annotations

import json
import os
from pathlib import Path


def plot_training_curves(
    metrics_file: str | os.PathLike, out_file: str | os.PathLike, smooth: int = 20
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    if not rows:
        return
    tokens = [r["tokens_seen"] / 1e6 for r in rows]

    def smoothed(values: list[float]) -> list[float]:
        window = max(1, min(smooth, len(values) // 10 or 1))
        return [
            sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))
        ]

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    loss_ax.plot(tokens, smoothed([r["loss"] for r in rows]))
    loss_ax.set(title="weighted block loss", xlabel="training tokens (M)", ylabel="loss")
    positions = len(rows[0]["accuracy_by_position"])
    for k in range(positions):
        acc_ax.plot(tokens, smoothed([r["accuracy_by_position"][k] for r in rows]), label=f"pos {k + 1}")
    acc_ax.set(title="top-1 accuracy by block position", xlabel="training tokens (M)", ylim=(0, 1))
    acc_ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)


def plot_learning_curve(points: list[dict], out_file: str | os.PathLike) -> None:
    """Held-out tau of each tree rule against training tokens, one point per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [p["tokens_seen"] / 1e6 for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    for rule in points[0]["tau"]:
        ax.plot(tokens, [p["tau"][rule] for p in points], marker="o", label=rule)
    ax.set(title="held-out acceptance length", xlabel="training tokens (M)", ylabel="tau (with bonus token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
