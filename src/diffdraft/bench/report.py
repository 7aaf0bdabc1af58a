"""The three outputs of a benchmark: results.json (every raw number), report.md (tables a person
reads) and PNG plots (speedup and tau vs DDTree budget, acceptance histograms, stage times)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers or in CI
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator, ScalarFormatter
from transformers import PreTrainedTokenizerBase

from diffdraft.bench.methods import REFERENCE, MethodSpec
from diffdraft.bench.runner import BenchRun
from diffdraft.bench.summary import ROUND_STAGES, Check, MethodSummary, Spread
from diffdraft.budget.cost import VerifyCostCurve

STAGE_LABELS = {
    "draft": "draft",
    "ngram": "n-gram lookups",
    "tree": "tree build",
    "mask": "tree mask",
    "verify_forward": "verify forward",
    "accept": "accept",
    "commit": "commit",
    "other": "other",
}
PAPER_LOOKUP_US = 6.0
"""The DART paper's N-gram lookup time per query (its C++ trie), for comparison."""
BUSY_WARNING = 0.2
"""Share of the CPU busy with other work above which the report warns that timings are unreliable."""
PLOTS = ("budget_sweep.png", "acceptance_histograms.png", "stage_times.png")


def write_outputs(
    out_dir: str | Path,
    header: dict,
    run: BenchRun,
    summaries: Sequence[MethodSummary],
    checks: Sequence[Check],
    curve: VerifyCostCurve | None,
    tokenizer: PreTrainedTokenizerBase,
) -> list[Path]:
    """Write every output into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        **header,
        "cost_curve": curve.to_dict() if curve else None,
        "summaries": [asdict(s) for s in summaries],
        "checks": [asdict(c) for c in checks],
        "records": [r.to_dict() for r in run.records],
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    (out / "report.md").write_text(markdown(header, run, summaries, checks, curve, tokenizer))
    written = [out / "results.json", out / "report.md"]
    written += [p for p in (plot_budget_sweep(summaries, out / PLOTS[0]),) if p]
    written.append(plot_histograms(summaries, out / PLOTS[1]))
    written.append(plot_stage_times(summaries, out / PLOTS[2]))
    return written


def _json_default(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")


def _spread(value: Spread, digits: int = 1, unit: str = "") -> str:
    if math.isnan(value.mean):
        return "–"
    text = f"{value.mean:.{digits}f}{unit}"
    if value.high > value.low:
        text += f" ({value.low:.{digits}f}–{value.high:.{digits}f})"
    return text


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _lossless(summary: MethodSummary) -> str:
    if summary.method == REFERENCE:
        return "reference"
    if not summary.compared:
        return "n/a (sampled)" if summary.temperature else "n/a (other dtype or engine)"
    if summary.violations:
        return f"**FAIL: {summary.violations} unexplained**"
    text = f"{summary.identical}/{summary.compared} identical"
    return text + (f", {summary.near_ties} near-tie" if summary.near_ties else "")


def markdown(
    header: dict,
    run: BenchRun,
    summaries: Sequence[MethodSummary],
    checks: Sequence[Check],
    curve: VerifyCostCurve | None,
    tokenizer: PreTrainedTokenizerBase,
) -> str:
    env = header["environment"]
    lines = [
        "# diffdraft bench",
        "",
        f"Command: `{header['command']}`",
        "",
        f"- target: {header['target']} ({header['dtype']}, {env['device']}); "
        f"drafter: {header['drafter'] or 'none'}"
        + (
            f"; DART drafter: {header['dart_drafter']} (N-gram trie: {header.get('ngram') or 'none'})"
            if header.get("dart_drafter")
            else ""
        )
        + (f"; DEER drafter: {header['deer_drafter']}" if header.get("deer_drafter") else ""),
        f"- machine: {env['cpu']}, {env['cores']} cores, {env['threads']} torch threads; "
        f"torch {env['torch']}, transformers {env['transformers']}; CPU busy with other work "
        f"{_percent(env['busy_before'])} before the run, {_percent(env['busy_after'])} after; "
        f"load average at the end {env['load_average']}",
        f"- {header['started']}, {header['elapsed_seconds']:.0f} s; options: "
        + ", ".join(f"{k} {v}" for k, v in header["options"].items()),
        "",
        "Speedup = tokens/s over plain AR (`ar`) on the same prompts; figures are means over repeats "
        "with the min–max across repeats in brackets. Bound = tau·t(1) / (t(q) + t_draft), with t(q) "
        "the measured cost of verifying q tokens (mask, forward, acceptance) at the contexts the rounds "
        "ran at, and t_draft the drafting time per round: the speedup if everything else were free. "
        "On CPU our methods run the target with diffdraft's inference kernels (packed bfloat16 "
        "weights, stacked q/k/v and gate/up projections, grouped-query attention without cache "
        "copies and, in bfloat16, with query groups as rows; logits identical in float32, equal up "
        "to rounding in bfloat16), Llama-shaped targets verify through a plain loop over their own "
        "modules (identical logits), and the KV cache appends and crops in place; Hugging Face "
        "methods run the stock "
        "model, so `ar` against `hf` is what the kernels alone buy.",
    ]
    if max(env["busy_before"] or 0.0, env["busy_after"] or 0.0) > BUSY_WARNING:
        lines += [
            "",
            "**Warning: other jobs kept the CPU busy around this run; timings and speedups are unreliable. "
            "Re-run on an idle machine.**",
        ]
    if checks:
        lines += [
            "",
            "## Checks",
            "",
            "| check | dataset | T | value | target | result | detail |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in checks:
            verdict = "PASS" if c.passed else "**FAIL**"
            lines.append(
                f"| {c.name} | {c.dataset} | {c.temperature:g} | {c.value:.3g} | {c.target:g} | "
                f"{verdict} | {c.detail} |"
            )
    conditions = list(dict.fromkeys((s.dataset, s.temperature) for s in summaries))
    for dataset, temperature in conditions:
        group = [s for s in summaries if (s.dataset, s.temperature) == (dataset, temperature)]
        lines += _condition(dataset, temperature, group)
    lines += _divergences(run, tokenizer)
    for label, plan in header.get("auto_budget", {}).items():
        budgets = list(plan["expected_tau"])
        scales = (
            ", ".join(f"x{scale:.2f} at q={q}" for q, scale in plan.get("cost_scales", {}).items())
            or "none yet"
        )
        lines += [
            "",
            f"## {label}: the cost model's view at the end of the run",
            "",
            f"At {plan['context']} cached tokens (the run's median round): "
            f"chosen budget {plan['budget']}; each node rank's expected acceptance gain from the "
            "rounds that verified it, weighed against the surrogate's gain times "
            f"{plan['growth_calibration']:.2f} (the share of its promise the target confirmed); "
            f"the cost curve rescaled by the rounds' own verification times ({scales}); "
            f"a lone sequence's drafting {plan['draft_ms']:.2f} ms a drafting round and commit "
            f"{plan['commit_ms']:.2f} ms a round (budget 0: plain decoding).",
            "",
            "| budget | " + " | ".join(str(b) for b in budgets) + " |",
            "|---" * (len(budgets) + 1) + "|",
            "| expected tau | " + " | ".join(f"{plan['expected_tau'][b]:.2f}" for b in budgets) + " |",
            "| expected tok/s | "
            + " | ".join(f"{plan['expected_tokens_per_second'][b]:.1f}" for b in budgets)
            + " |",
        ]
    if curve is not None:
        lines += [
            "",
            f"## Verification cost t(q, n) on this machine (ms; measured {curve.measured_at})",
            "",
            "Medians fitted nondecreasing in q and n (the planner's curve); measured medians in "
            "`results.json` (`cost_curve.measured`).",
            "",
            "| cached tokens n \\ q | " + " | ".join(str(q) for q in curve.sizes) + " |",
            "|---" * (len(curve.sizes) + 1) + "|",
            *(
                f"| {n} | " + " | ".join(f"{1e3 * t:.1f}" for t in row) + " |"
                for n, row in zip(curve.contexts, curve.seconds, strict=True)
            ),
        ]
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _condition(dataset: str, temperature: float, group: list[MethodSummary]) -> list[str]:
    lines = [
        "",
        f"## {dataset}, temperature {temperature:g}",
        "",
        "| method | tok/s | decode tok/s | speedup vs AR | vs HF greedy | tau | bound | of bound "
        "| lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in group:
        vs_hf = f"{s.speedup_vs_hf:.2f}x" if s.speedup_vs_hf else "–"
        bound = f"{s.bound:.2f}x" if s.bound else "–"
        fraction = f"{100 * s.bound_fraction:.0f}%" if s.bound_fraction else "–"
        lines.append(
            f"| {s.method} | {_spread(s.tokens_per_second)} | {s.decode_tokens_per_second:.1f} | "
            f"{_spread(s.speedup, 2, 'x')} | {vs_hf} | "
            f"{s.tau:.2f} | {bound} | {fraction} | {_lossless(s)} |"
        )
    lines += [
        "",
        "Time per verification round (ms); prefill per generation. Draft latency = draft (the drafter's "
        "forward) + n-gram lookups (DART's tree querying its N-gram trie) + tree build (the tree search "
        "without those lookups):",
        "",
        "| method | rounds | tokens verified | "
        + " | ".join(STAGE_LABELS[s] for s in ROUND_STAGES)
        + " | round total | prefill |",
        "|---" * (len(ROUND_STAGES) + 5) + "|",
    ]
    for s in group:
        stages = " | ".join(f"{s.stage_ms.get(stage, 0.0):.1f}" for stage in ROUND_STAGES)
        lines.append(
            f"| {s.method} | {s.rounds} | {s.mean_verify_tokens:.1f} | {stages} | "
            f"{sum(s.stage_ms.values()):.1f} | {s.prefill_ms:.0f} |"
        )
    looked_up = [s for s in group if s.ngram_lookup_us is not None]
    if looked_up:
        lines += [
            "",
            "N-gram lookups (one `log_probs` query of the trie, each timed; median over the generations' "
            "medians, weighted by lookups; the DART paper's C++ trie takes "
            f"{PAPER_LOOKUP_US:g} us per query):",
            "",
            "| method | lookups per round | median us per lookup | mean us per lookup | ms per round |",
            "|---|---|---|---|---|",
        ]
        for s in looked_up:
            per_round = s.stage_ms.get("ngram", 0.0)
            mean = 1e3 * per_round / s.ngram_lookups_per_round if s.ngram_lookups_per_round else 0.0
            lines.append(
                f"| {s.method} | {s.ngram_lookups_per_round:.1f} | {s.ngram_lookup_us:.1f} | {mean:.1f} | "
                f"{per_round:.2f} |"
            )
    lines += [
        "",
        "Acceptance (tau counts the bonus token; position d = draft token d accepted, given d-1 were):",
        "",
        "| method | tau | acceptance length: rounds | acceptance rate at position 1, 2, ... |",
        "|---|---|---|---|",
    ]
    for s in group:
        histogram = ", ".join(f"{k}: {v}" for k, v in s.histogram.items())
        positions = " ".join(f"{rate:.2f}" for rate in s.position_acceptance[:16])
        budgets = (
            f" (budgets used: {', '.join(f'{b}: {n}' for b, n in s.budgets.items())})" if s.budgets else ""
        )
        lines.append(f"| {s.method}{budgets} | {s.tau:.2f} | {histogram} | {positions or '–'} |")
    return lines


def _divergences(run: BenchRun, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """One row per distinct divergence; repeats of the same prompt usually diverge identically."""
    rows: dict[tuple, int] = {}
    for r in run.records:
        if r.divergence is not None:
            key = (r.dataset, r.sample_id, r.turn, r.method, tuple(sorted(r.divergence.items())))
            rows[key] = rows.get(key, 0) + 1
    if not rows:
        return []
    lines = [
        "",
        "## Divergences from plain AR (first divergent position; logits recomputed in float32)",
        "",
        "| dataset | sample | turn | method | repeats | position | AR token | method token | top-2 margin "
        "| gap | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dataset, sample, turn, method, items), count in rows.items():
        d = dict(items)
        verdict = "near-tie" if d["explained"] else "**BUG: clear margin**"
        lines.append(
            f"| {dataset} | {sample} | {turn} | {method} | {count} | {d['position']} | "
            f"{_token(tokenizer, d['reference_token'])} | {_token(tokenizer, d['method_token'])} | "
            f"{d['margin']:.3f} | {d['gap']:.3f} | {verdict} |"
        )
    return lines


def _token(tokenizer: PreTrainedTokenizerBase, token: int | None) -> str:
    if token is None:
        return "(end)"
    text = tokenizer.decode([token]).replace("|", "\\|").replace("\n", "\\n").replace("`", "'")
    return f"{token} `{text}`"


def plot_budget_sweep(summaries: Sequence[MethodSummary], path: Path) -> Path | None:
    """Speedup and tau against the DDTree budget, one line per tree method (ddtree, ddtree+pld),
    dataset and temperature; auto as a star."""
    ddtree = [s for s in summaries if MethodSpec.parse(s.method).name.startswith("ddtree")]
    if not ddtree:
        return None
    figure, (speed_axis, tau_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = dict.fromkeys((MethodSpec.parse(s.method).name, s.dataset, s.temperature) for s in ddtree)
    for name, dataset, temperature in lines:
        group = [
            s
            for s in ddtree
            if (MethodSpec.parse(s.method).name, s.dataset, s.temperature) == (name, dataset, temperature)
        ]
        swept = sorted(
            (int(MethodSpec.parse(s.method).arg or 32), s)
            for s in group
            if MethodSpec.parse(s.method).arg != "auto"
        )
        label = f"{name}, {dataset}, T={temperature:g}"
        if swept:
            budgets = [b for b, _ in swept]
            errors = [
                [s.speedup.mean - s.speedup.low for _, s in swept],
                [s.speedup.high - s.speedup.mean for _, s in swept],
            ]
            line = speed_axis.errorbar(
                budgets, [s.speedup.mean for _, s in swept], yerr=errors, marker="o", capsize=3, label=label
            )[0]
            tau_axis.plot(budgets, [s.tau for _, s in swept], marker="o", color=line.get_color(), label=label)
            color = line.get_color()
        else:
            color = None
        for s in group:
            if MethodSpec.parse(s.method).arg == "auto" and s.budgets:
                typical = max(s.budgets, key=s.budgets.get)
                speed_axis.plot(
                    [typical],
                    [s.speedup.mean],
                    marker="*",
                    markersize=14,
                    color=color,
                    linestyle="none",
                    label=f"{label} auto",
                )
                tau_axis.plot([typical], [s.tau], marker="*", markersize=14, color=color, linestyle="none")
    for axis, title in ((speed_axis, "speedup vs plain AR"), (tau_axis, "tau (mean acceptance length)")):
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.set_xlabel("DDTree budget (nodes)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    handles, labels = speed_axis.get_legend_handles_labels()
    rows = math.ceil(len(labels) / 4)
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    figure.tight_layout(rect=(0, 0.05 * rows, 1, 1))  # the legend sits below both plots
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_histograms(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Acceptance-length distribution per method (share of rounds), one bar group per condition."""
    methods = list(dict.fromkeys(s.method for s in summaries))
    conditions = list(dict.fromkeys((s.dataset, s.temperature) for s in summaries))
    columns = min(3, len(methods))
    rows = math.ceil(len(methods) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3 * rows), squeeze=False)
    width = 0.8 / len(conditions)
    for axis, method in zip(axes.flat, methods, strict=False):
        for index, condition in enumerate(conditions):
            summary = next(
                (s for s in summaries if s.method == method and (s.dataset, s.temperature) == condition), None
            )
            if summary is None or not summary.rounds:
                continue
            lengths = list(summary.histogram)
            shares = [summary.histogram[n] / summary.rounds for n in lengths]
            axis.bar(
                [n + (index - (len(conditions) - 1) / 2) * width for n in lengths],
                shares,
                width=width,
                label=f"{condition[0]}, T={condition[1]:g}",
            )
        axis.set_title(f"{method}")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("tokens per round")
        axis.set_ylabel("share of rounds")
    for axis in list(axes.flat)[len(methods) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_stage_times(summaries: Sequence[MethodSummary], path: Path) -> Path:
    """Milliseconds per round split by stage, a stacked bar per method, one panel per condition."""
    conditions = list(dict.fromkeys((s.dataset, s.temperature) for s in summaries))
    figure, axes = plt.subplots(
        1, len(conditions), figsize=(5.5 * len(conditions), 0.45 * len(summaries) + 2), squeeze=False
    )
    for axis, condition in zip(axes.flat, conditions, strict=True):
        group = [s for s in summaries if (s.dataset, s.temperature) == condition]
        left = [0.0] * len(group)
        for stage in ROUND_STAGES:
            values = [s.stage_ms.get(stage, 0.0) for s in group]
            axis.barh([s.method for s in group], values, left=left, label=STAGE_LABELS[stage])
            left = [a + b for a, b in zip(left, values, strict=True)]
        axis.invert_yaxis()
        axis.set_title(f"{condition[0]}, T={condition[1]:g}")
        axis.set_xlabel("ms per verification round")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
