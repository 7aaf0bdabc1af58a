"""The outputs of the synthetic round benchmark: results.json (every number), report.md (the table a
person reads), round_stages.png (round time per stage, method by method in budget order) and, when
profiled, profile.md (what one round launches, copies and waits for)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or in CI
import matplotlib.pyplot as plt

from diffdraft.bench.synthetic import ACCEPTANCE, OFFICIAL, REFERENCE, ROUND_STAGES, count_text

RESULTS, REPORT, PLOT, PROFILE = "results.json", "report.md", "round_stages.png", "profile.md"
SYNC_EVENTS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "aten::_local_scalar_dense",
    "aten::copy_",
    "aten::to",
)
"""Profiler rows that count host syncs, copies and launches: device syncs are the stage timer's,
stream syncs a tensor read on the host (``.item()``, ``.tolist()``), memcpy a copy either way."""


def write_outputs(results: dict, out_dir: str | Path) -> list[Path]:
    """Write every output into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS).write_text(json.dumps(results, indent=1) + "\n")
    (out / REPORT).write_text(markdown(results))
    written = [out / RESULTS, out / REPORT, plot_round_stages(results, out / PLOT)]
    if results.get("profiles"):
        (out / PROFILE).write_text(profile_markdown(results["profiles"]))
        written.append(out / PROFILE)
    return written


def markdown(results: dict) -> str:
    """The run's context, then one row per method."""
    settings, env, shapes = results["settings"], results["environment"], results["shapes"]
    target, drafter = shapes["target"], shapes["drafter"]
    lines = [
        f"# Synthetic round benchmark: {settings['shape']} on {env['device_name']} ({env['dtype']})",
        "",
        "Random weights of real shapes: a round costs what the trained models' would, and the acceptance",
        "is fixed (below), so round times compare at equal tau: `dflash / this` is then the speed ratio",
        "of this method over the official loop.",
        "",
        "| | |",
        "|---|---|",
        f"| command | `{env['command']}` |",
        f"| device | {env['device_name']} ({env['device']}, {env['threads']} CPU threads) |",
        f"| versions | torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
        f"dflash {env['dflash']}, diffdraft {env['diffdraft']}, Python {env['python']} |",
        f"| target | Qwen3, hidden {target['hidden_size']}, {target['num_hidden_layers']} layers, "
        f"{target['num_attention_heads']} heads ({target['num_key_value_heads']} KV, head dim "
        f"{target['head_dim']}), MLP {target['intermediate_size']}, vocab {target['vocab_size']}: "
        f"{count_text(target['parameters'])} parameters |",
        f"| drafter | DFlash, {drafter['layers']} layers, block {drafter['block_size']}, taps "
        f"{drafter['target_layer_ids']}, mask token {drafter['mask_token_id']}: "
        f"{count_text(drafter['parameters'])} parameters (plus the target's embedding and head) |",
        f"| acceptance | {settings['acceptance']}: {ACCEPTANCE[settings['acceptance']]} |",
        f"| context | {settings['context']} prompt tokens, plus what the warm-up and timed rounds add |",
        f"| rounds | {settings['rounds']} timed per method and repeat, after {settings['warmup']} warm-up; "
        f"{settings['repeats']} interleaved repeat(s) |",
        "| verification | "
        + ("replayed from CUDA graphs |" if settings.get("cuda_graphs") else "eager (no CUDA graphs) |"),
        "| attention | "
        + (
            f"SDPA backends {', '.join(settings['sdpa_backends'])} only |"
            if settings.get("sdpa_backends")
            else "torch's choice of SDPA backend |"
        ),
        f"| run | {results['seconds']:.0f} s; peak GPU memory "
        + (f"{env['cuda_max_memory_gib']:.1f} GiB |" if env["cuda_max_memory_gib"] is not None else "n/a |"),
        "",
        "Milliseconds per round (stage columns: means; `other` is the round's time outside the stages).",
        "`break-even tau`: the acceptance a trained drafter needs for this method to match plain decoding.",
        "",
        "| method | loop | tokens verified | tau | round ms median | round ms mean | "
        + " | ".join(ROUND_STAGES)
        + " | other | break-even tau | dflash / this | tokens = AR's |",
        "|---|---|" + "---:|" * (len(ROUND_STAGES) + 8),
    ]
    for m in results["methods"]:
        stages = m["stage_ms"]
        cells = [f"{stages[s]:.2f}" if s in stages else "" for s in (*ROUND_STAGES, "other")]
        lines.append(
            f"| {m['method']} | {m['loop']} | {m['verified_tokens']:.1f} | {m['tau']:.2f} | "
            f"{m['round_ms_median']:.2f} | {m['round_ms_mean']:.2f} | "
            + " | ".join(cells)
            + f" | {_number(m['break_even_tau'])} | {_number(m['official_over_this'])} | "
            f"{m['tokens_matching_ar']}/{m['tokens_compared']} |"
        )
    if results["official_error"]:
        lines += ["", f"The official loop did not run: {results['official_error']}"]
    return "\n".join(lines) + "\n"


def plot_round_stages(results: dict, path: Path) -> Path:
    """A stacked bar of stage times per method (DDTree by budget), the official loop as one total."""
    methods = results["methods"]
    figure, axis = plt.subplots(figsize=(1.1 * len(methods) + 3, 4.5))
    names = [m["method"] for m in methods]
    bottom = [0.0] * len(methods)
    for stage in (*ROUND_STAGES, "other"):
        values = [max(0.0, m["stage_ms"].get(stage, 0.0)) for m in methods]
        axis.bar(names, values, bottom=bottom, label=stage)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    official = [m["round_ms_mean"] if m["method"] == OFFICIAL else 0.0 for m in methods]
    axis.bar(names, official, color="none", edgecolor="black", hatch="//", label="dflash loop (total)")
    for index, m in enumerate(methods):
        axis.annotate(f"τ {m['tau']:.2f}", (index, m["round_ms_mean"]), ha="center", va="bottom", fontsize=8)
    settings, env = results["settings"], results["environment"]
    axis.set_title(
        f"{settings['shape']} on {env['device_name']}, {env['dtype']}, context {settings['context']}",
        fontsize=9,
    )
    axis.set_ylabel("ms per round (mean)")
    axis.set_xlabel(f"method ({REFERENCE}: plain decoding; ddtree:B: B drafted nodes)")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def profile_markdown(profiles: dict) -> str:
    """Per profiled method, the sync, copy and launch counts per round, then its costliest operators."""
    lines = ["# What one round launches, copies and waits for", ""]
    for method, profile in profiles.items():
        rows = profile["per_round"]
        lines += [
            f"## {method}",
            "",
            f"{profile['rounds']} rounds profiled after the prefill and warm-up; `diffdraft.<stage>` rows are"
            " the stages' host time outside the operators listed.",
            "",
            "| event | per round |",
            "|---|---:|",
            *(f"| {name} | {rows[name]['count']:.1f} |" for name in SYNC_EVENTS if name in rows),
            "",
            "| operator (top by self time) | calls per round | self CPU ms | self device ms |",
            "|---|---:|---:|---:|",
        ]
        top = sorted(rows.items(), key=lambda row: -max(row[1]["self_cpu_ms"], row[1]["self_device_ms"]))
        lines += [
            f"| {name} | {row['count']:.1f} | {row['self_cpu_ms']:.3f} | {row['self_device_ms']:.3f} |"
            for name, row in top[:25]
        ]
        lines.append("")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"
