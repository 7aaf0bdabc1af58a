"""Whole-batch throughput: tokens/s of our methods at several batch sizes, on the same prompts.

Each method generates every prompt with continuous batching (``generate_batch``) at each batch
size, interleaved (batch size outermost per repeat, methods rotating), and every output is checked
against plain AR at batch 1; an auto budget is also set beside the best fixed choice at each size.
A second table measures what one packed verification forward costs for B sequences of q tokens
each: speculation pays while tau exceeds t(B, q) / t(B, 1), and a CPU's forward cost grows with the
total tokens B·q, so the batch that AR fills with B tokens the trees fill B·q times over.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")  # files only: no display on servers or in CI
import matplotlib.pyplot as plt

from diffdraft.bench.lossless import LosslessChecker
from diffdraft.bench.methods import REFERENCE, OursRunner
from diffdraft.bench.runner_api import MethodSpec
from diffdraft.errors import InvalidRequestError
from diffdraft.generator import GenerationRequest
from diffdraft.target.model import TargetModel, VerifyInput
from diffdraft.util.progress import progress_bar

COST_TREE_SIZES = (1, 9, 17, 33)
"""Tokens per sequence in the verify-cost table: plain decoding, and trees of 8, 16 and 32 nodes."""
COST_CONTEXT = 256


@dataclass
class BatchPoint:
    method: str
    batch_size: int
    seconds: list[float] = field(default_factory=list)
    """Wall time of the whole batch of prompts, per repeat."""
    tokens: int = 0
    """Tokens generated over all prompts (one repeat)."""
    taus: list[float] = field(default_factory=list)
    """Mean tokens per sequence per round, per repeat (an auto budget's differ: it learns as it goes)."""
    identical: int = 0
    near_ties: int = 0
    violations: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Over the median repeat: on a shared machine a pass that another process slowed down (we saw
        one take far longer than its twins) must not move the row (docs/decisions.md, "a batch-bench
        row reads its median repeat")."""
        return self.tokens / float(np.median(self.seconds)) if self.seconds else float("nan")

    @property
    def tau(self) -> float:
        """The tau of a median repeat (the upper of two middle ones), beside its throughput."""
        if not self.taus:
            return 0.0
        return self.taus[int(np.argsort(self.seconds, kind="stable")[len(self.seconds) // 2])]


def run_batch_benchmark(
    runners: Sequence[OursRunner],
    prompts: Sequence[list[int]],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    repeats: int,
    checker: LosslessChecker,
    progress: bool = True,
) -> list[BatchPoint]:
    """Every method at every batch size over all ``prompts`` (greedy), ``repeats`` times."""
    reference = next((r for r in runners if r.spec.label == REFERENCE), None)
    if reference is None:
        raise InvalidRequestError("the batch benchmark needs plain AR (method 'ar') as the reference")
    requests = [GenerationRequest(prompt_token_ids=p, max_new_tokens=max_new_tokens) for p in prompts]
    points = {(r.spec.label, b): BatchPoint(r.spec.label, b) for r in runners for b in batch_sizes}
    for runner in runners:  # warm-up: kernels, caches and the auto budget's first rounds
        runner.generator.generate_batch(requests[: max(batch_sizes)], max(batch_sizes))
    expected = [r.token_ids for r in reference.generator.generate_batch(requests, 1)]
    total = repeats * len(points)
    with progress_bar(total=total, desc="batch bench", unit="batch", disable=not progress) as bar:
        rotation = 0
        for repeat in range(repeats):
            for batch_size in batch_sizes:
                order = [*runners[rotation:], *runners[:rotation]]
                rotation = (rotation + 1) % len(runners)
                for runner in order:
                    point = points[runner.spec.label, batch_size]
                    begin = time.perf_counter()
                    results = runner.generator.generate_batch(requests, batch_size)
                    point.seconds.append(time.perf_counter() - begin)
                    lengths = [n for r in results for n in r.stats.acceptance_lengths]
                    point.taus.append(float(np.mean(lengths)) if lengths else 0.0)
                    if repeat == 0:
                        _check(point, results, expected, prompts, checker)
                    bar.update()
                    bar.set_postfix_str(f"{runner.spec.label} batch {batch_size}")
    return list(points.values())


def _check(point: BatchPoint, results, expected, prompts, checker: LosslessChecker) -> None:
    point.tokens = sum(len(r.token_ids) for r in results)
    for result, reference, prompt in zip(results, expected, prompts, strict=True):
        divergence = checker.check(list(prompt), reference, result.token_ids)
        if divergence is None:
            point.identical += 1
        elif divergence.explained:
            point.near_ties += 1
        else:
            point.violations += 1


@dataclass
class BatchVerifyCost:
    context: int
    """Cached tokens of every sequence."""
    seconds: dict[int, dict[int, float]]
    """{B: {q: median seconds of one packed forward of B sequences with q tokens each}}."""


def measure_batch_verify_cost(
    target: TargetModel, batch_sizes: Sequence[int], sizes: Sequence[int] = COST_TREE_SIZES, repeats: int = 5
) -> BatchVerifyCost:
    """What one packed verification forward costs for B sequences of q tokens (chains), every
    sequence over its own cache of :data:`COST_CONTEXT` tokens (less on a short-context target)."""
    context = max(1, min(COST_CONTEXT, target.max_context - max(sizes)))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (context + max(sizes),), generator=generator).to(target.device)
    caches = []
    for _ in range(max(batch_sizes)):
        cache = target.new_cache()
        target.prefill(cache, ids[:context], [])
        caches.append(cache)
    timings: dict[tuple[int, int], list[float]] = {(b, q): [] for b in batch_sizes for q in sizes}
    for repeat in range(repeats + 1):  # the first pass warms up and is not kept
        for b, q in timings:
            chain = torch.tril(torch.ones(q, q, dtype=torch.bool))
            mask = target.attention_mask(caches[0], chain) if q > 1 else None
            tokens = ids[context : context + q]
            positions = torch.arange(context, context + q, device=target.device)
            inputs = [VerifyInput(cache, tokens, positions, mask) for cache in caches[:b]]
            begin = time.perf_counter()
            target.verify_batch(inputs, [])
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            if repeat:
                timings[b, q].append(time.perf_counter() - begin)
            for cache in caches[:b]:
                cache.crop(-q)
    seconds = {b: {q: float(np.median(timings[b, q])) for q in sizes} for b in batch_sizes}
    return BatchVerifyCost(context, seconds)


def write_batch_outputs(
    out_dir: str | Path, header: dict, points: Sequence[BatchPoint], cost: BatchVerifyCost
) -> list[Path]:
    """batch.json, batch.md and batch_throughput.png in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        **header,
        "points": [asdict(p) | {"tokens_per_second": p.tokens_per_second, "tau": p.tau} for p in points],
        "verify_cost": {
            "context": cost.context,
            "seconds": {str(b): {str(q): s for q, s in row.items()} for b, row in cost.seconds.items()},
        },
    }
    (out / "batch.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "batch.md").write_text(batch_markdown(header, points, cost))
    return [
        out / "batch.json",
        out / "batch.md",
        plot_batch_throughput(points, cost, out / "batch_throughput.png"),
    ]


def batch_markdown(header: dict, points: Sequence[BatchPoint], cost: BatchVerifyCost) -> str:
    sizes = sorted({p.batch_size for p in points})
    methods = list(dict.fromkeys(p.method for p in points))
    by = {(p.method, p.batch_size): p for p in points}
    ar = {b: by[REFERENCE, b].tokens_per_second for b in sizes}
    lines = [
        "# diffdraft bench: whole-batch throughput",
        "",
        f"Command: `{header['command']}`",
        "",
        f"- {header['machine']}; {header['started']}, {header['elapsed_seconds']:.0f} s",
        f"- {header['prompts']} prompts, {header['max_new_tokens']} new tokens each, greedy, "
        f"{header['repeats']} repeats (the median repeat's time counts); a batch size of B keeps up to "
        "B sequences in every round (continuous batching: a waiting prompt joins when one finishes)",
        "",
        "Tokens/s of the whole batch (speedup over `ar` at the same batch size in brackets; tau = "
        "mean tokens per sequence per round in the median repeat):",
        "",
        "| method | " + " | ".join(f"batch {b}" for b in sizes) + " | lossless vs ar at batch 1 |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for method in methods:
        cells = []
        for b in sizes:
            point = by[method, b]
            cells.append(
                f"{point.tokens_per_second:.1f} ({point.tokens_per_second / ar[b]:.2f}x, tau {point.tau:.2f})"
            )
        checked = [by[method, b] for b in sizes]
        lossless = (
            f"{sum(p.identical for p in checked)} identical, {sum(p.near_ties for p in checked)} near-tie, "
            f"{sum(p.violations for p in checked)} unexplained"
        )
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {lossless} |")
    paired = [
        (method, [_paired_cell(paired_ratios(by[method, b], by[REFERENCE, b])) for b in sizes])
        for method in methods
        if method != REFERENCE
    ]
    lines += _ratio_table(
        "The same ratios per repeat: a method's throughput over `ar`'s in the same repeat at the same "
        "batch size (they ran back to back), median [lowest-highest] over the repeats; the spread is "
        "what the machine's noise does to one repeat:",
        sizes,
        paired,
    )
    lines += _auto_against_fixed(by, methods, sizes)
    qs = sorted(next(iter(cost.seconds.values())))
    lines += [
        "",
        f"One packed verification forward, B sequences of q tokens each over {cost.context} cached tokens "
        "apiece (ms; t(B, q) / t(B, 1) in brackets: the tau a tree of q - 1 nodes needs to pay for itself "
        "at that batch size):",
        "",
        "| batch | " + " | ".join(f"q = {q}" for q in qs) + " |",
        "|---|" + "---|" * len(qs),
    ]
    for b, row in cost.seconds.items():
        lines.append(
            f"| {b} | " + " | ".join(f"{1000 * row[q]:.1f} ({row[q] / row[1]:.2f})" for q in qs) + " |"
        )
    return "\n".join(lines) + "\n"


def _auto_against_fixed(
    by: dict[tuple[str, int], BatchPoint], methods: list[str], sizes: list[int]
) -> list[str]:
    """The table of each auto budget against the best fixed choice at each batch size (``ar`` or a
    fixed budget, whichever the median repeats put first), repeat by repeat: what a user who tried
    every fixed choice by hand would have picked. Paired, as the table against ``ar``: the machine's
    drift moves two methods' median repeats apart (a run missed by its medians where its paired
    repeats read even; docs/decisions.md, "auto budgets against the best fixed choice, paired per
    repeat")."""
    autos = [m for m in methods if MethodSpec.parse(m).arg == "auto"]
    fixed = [m for m in methods if m not in autos]
    if not autos or len(fixed) < 2:
        return []
    best = {b: max(fixed, key=lambda m: by[m, b].tokens_per_second) for b in sizes}
    rows = [
        (method, [f"{_paired_cell(paired_ratios(by[method, b], by[best[b], b]))} ({best[b]})" for b in sizes])
        for method in autos
    ]
    return _ratio_table(
        "Each auto budget against the best fixed choice at the same batch size (`ar` or a fixed budget, "
        "whichever the median repeats put first, named in brackets), repeat by repeat as above:",
        sizes,
        rows,
    )


def _ratio_table(intro: str, sizes: list[int], rows: list[tuple[str, list[str]]]) -> list[str]:
    """A report table: ``intro``, then one row per (method, its cell per batch size)."""
    return [
        "",
        intro,
        "",
        "| method | " + " | ".join(f"batch {b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
        *(f"| {method} | " + " | ".join(cells) + " |" for method, cells in rows),
    ]


def paired_ratios(point: BatchPoint, reference: BatchPoint) -> list[float]:
    """``point``'s throughput over ``reference``'s, repeat by repeat (the same tokens, so the ratio of
    the reference's seconds to the point's)."""
    return [plain / mine for mine, plain in zip(point.seconds, reference.seconds, strict=True)]


def _paired_cell(ratios: list[float]) -> str:
    return f"{np.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios else "-"


def plot_batch_throughput(points: Sequence[BatchPoint], cost: BatchVerifyCost, path: Path) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(p.method for p in points):
        mine = sorted((p for p in points if p.method == method), key=lambda p: p.batch_size)
        left.plot([p.batch_size for p in mine], [p.tokens_per_second for p in mine], marker="o", label=method)
    left.set(xlabel="batch size", ylabel="tokens/s (whole batch)", title="Throughput vs batch size")
    left.set_xscale("log", base=2)
    left.legend()
    sizes = sorted(cost.seconds)
    for q in sorted(cost.seconds[sizes[0]]):
        right.plot(sizes, [1000 * cost.seconds[b][q] for b in sizes], marker="o", label=f"q = {q}")
    right.set(xlabel="batch size B", ylabel="ms per forward", title="Packed verification cost t(B, q)")
    right.set_xscale("log", base=2)
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
