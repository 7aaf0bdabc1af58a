"""``diffdraft bench``: every method side by side on real prompts, lossless-checked, with a report."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from diffdraft.bench.datasets import BUILTIN, load_samples
from diffdraft.bench.journal import Journal
from diffdraft.bench.lossless import TIE_TOLERANCE, LosslessChecker
from diffdraft.bench.machine import cpu_name
from diffdraft.bench.methods import (
    REFERENCE,
    BenchModels,
    MethodSpec,
    MethodUnavailable,
    OursRunner,
    build_method,
    default_specs,
    registered,
)
from diffdraft.bench.records import Record
from diffdraft.bench.runner import BenchOptions, encode_turn, run_benchmark
from diffdraft.bench.summary import checks, summarize
from diffdraft.errors import InvalidRequestError

# Defaults of a full run and of --quick (a couple of minutes on 2 cores); explicit flags win over both.
FULL = {
    "datasets": "humaneval,mtbench,sharegpt",
    "samples": 8,
    "max_new_tokens": 256,
    "repeats": 3,
    "budgets": "8,16,32,64,128,auto",
}
BATCH_METHODS = ("ar", "ddtree:8", "ddtree+pld:8")
"""What --batch-sizes measures unless --methods says otherwise."""
QUICK = {
    "datasets": "humaneval,mtbench",
    "samples": 2,
    "max_new_tokens": 32,
    "repeats": 2,
    "budgets": "32,auto",
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="benchmark every method side by side (speed, acceptance, losslessness) and write a report",
        description=__doc__,
    )
    p.add_argument("--target", default="default", help="model directory, .gguf file, or 'default'")
    p.add_argument(
        "--drafter",
        default=None,
        help="DFlash/DFlare checkpoint directory, or 'default' (the shipped drafter of the default "
        "target); enables chain, ddtree and dart-tree:SIZE (DART's N-gram-pruned tree over this drafter)",
    )
    p.add_argument(
        "--dart-drafter",
        default=None,
        help="DART checkpoint directory, or 'default-dart' (the shipped DART drafter of the default target); "
        "enables dart:SIZE (DART's N-gram-pruned tree of SIZE nodes, default 59), dart-no-ngram:SIZE (the "
        "same tree without the N-gram term) and ddtree-dart:BUDGET (DDTree over DART's distributions)",
    )
    p.add_argument(
        "--deer-drafter",
        default=None,
        help="DEER checkpoint directory, or 'default-deer' (the shipped DEER drafter of the default target; "
        "the default with --target default); enables deer (DEER's chain, rejection-sampled) and "
        "deer-tree:BUDGET (DDTree over DEER's distributions, default 32)",
    )
    p.add_argument(
        "--ngram",
        default=None,
        help="N-gram trie of the dart tree: a directory built by `diffdraft ngram build`, 'default' (the "
        "default target's, built once into the cache) or 'none' (default: 'default' with --target default, "
        "else none)",
    )
    p.add_argument("--assistant", default=None, help="small model directory for HF assisted generation")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list of name[:arg][@dtype] (registered: {', '.join(registered())}); 'ddtree' alone "
        "expands to --budgets; the dart methods take a tree size (default 59), deer-tree a budget (default "
        "32); default: every method the given models allow",
    )
    p.add_argument(
        "--budgets", default=None, help=f"DDTree budgets, 'auto' included (default {FULL['budgets']})"
    )
    p.add_argument(
        "--datasets",
        default=None,
        help=f"comma list of {', '.join(BUILTIN)} or jsonl paths (default {FULL['datasets']})",
    )
    p.add_argument(
        "--samples", type=int, default=None, help=f"samples per dataset (default {FULL['samples']})"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {FULL['max_new_tokens']}")
    p.add_argument("--temperatures", default="0", help="comma list; 0 = greedy (default 0)")
    p.add_argument(
        "--repeats", type=int, default=None, help=f"timed repeats per prompt (default {FULL['repeats']})"
    )
    p.add_argument("--seed", type=int, default=0, help="repeat r of a sampled run uses seed + r")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the untimed warm-up per method")
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=None,
        help="largest float32 logit gap a bf16 divergence may have (default: 0 in float32, 0.5 in bfloat16)",
    )
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    p.add_argument("--quick", action="store_true", help=f"a couple of minutes: {QUICK}")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in --out (same command, same machine): finished prompts are kept",
    )
    p.add_argument(
        "--refresh-cost",
        action="store_true",
        help="re-measure the cached verification cost curves (one sequence, and batches)",
    )
    p.add_argument(
        "--cost-cache", default=None, help="where cost curves are cached (default: the diffdraft cache)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice, one per core)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="measure whole-batch throughput instead: comma list of batch sizes, e.g. 1,2,4,8 (every prompt "
        f"generated with continuous batching at each size; default methods {','.join(BATCH_METHODS)}); "
        "writes batch.md, batch.json and batch_throughput.png",
    )
    return p


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and write the outputs; exit code 1 when a lossless check failed."""
    from diffdraft.bench.report import write_outputs  # matplotlib loads only when a benchmark runs

    started = time.time()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    busy_before = _cpu_busy()
    batch_sizes = _batch_sizes(args.batch_sizes) if args.batch_sizes is not None else None
    if batch_sizes is not None and args.methods is None:
        args.methods = ",".join(BATCH_METHODS)
    options = _resolve(args)
    progress = not args.no_progress
    models = BenchModels(
        args.target,
        dtype=args.dtype,
        device=args.device,
        drafter=args.drafter,
        assistant=args.assistant,
        cost_cache=args.cost_cache,
        refresh_cost=args.refresh_cost,
        progress=progress,
        dart_drafter=args.dart_drafter,
        ngram=_ngram(args),
        deer_drafter=_deer_drafter(args),
    )
    if batch_sizes is not None:
        return _run_batch_bench(args, models, options, batch_sizes, started)
    if args.methods is None and models.dtype_name != "float32":
        # the baseline users know, in whichever dtype is fastest for it on this machine
        options["methods"].append(MethodSpec("hf", dtype="float32"))
    runners = _build_runners(models, options["methods"], explicit=args.methods is not None)
    samples = [s for name in options["datasets"] for s in load_samples(name, options["samples"])]
    tolerance = args.tie_tolerance
    if tolerance is None:
        tolerance = TIE_TOLERANCE[models.main.model.dtype]
    checker = LosslessChecker(lambda: models.target("float32", optimized=False).model, tolerance)
    bench = BenchOptions(
        max_new_tokens=options["max_new_tokens"],
        temperatures=options["temperatures"],
        repeats=options["repeats"],
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        progress=progress,
    )
    curve = models.cost_curve()
    command = _command(args, options)
    journal = Journal(args.out, {"command": command} | _machine(models), resume=args.resume)
    run = run_benchmark(runners, samples, models.tokenizer, checker, bench, journal)
    summaries = summarize(run.records, curve, models.dtype_name)
    found = checks(summaries)
    header = {
        "command": command,
        "target": models.main.source,
        "dtype": models.dtype_name,
        "drafter": args.drafter,
        "dart_drafter": args.dart_drafter,
        "ngram": _ngram(args) if args.dart_drafter else None,
        "deer_drafter": _deer_drafter(args) if any(r.spec.name.startswith("deer") for r in runners) else None,
        "assistant": args.assistant,
        "methods": [r.spec.label for r in runners],
        "options": {k: v for k, v in options.items() if k != "methods"} | {"tie_tolerance": tolerance},
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "elapsed_seconds": time.time() - started,
        "environment": _environment(models, busy_before),
        "auto_budget": {
            r.spec.label: r.auto.describe(_median_context(run.records, r.spec.label))
            for r in runners
            if getattr(r, "auto", None)
        },
    }
    written = write_outputs(args.out, header, run, summaries, found, curve, models.tokenizer)
    journal.close()
    for summary in summaries:
        print(
            f"{summary.dataset:>10} T={summary.temperature:g} {summary.method:>16}: "
            f"{summary.tokens_per_second.mean:6.1f} tok/s  {summary.speedup.mean:5.2f}x  "
            f"tau {summary.tau:.2f}"
        )
    for check in found:
        print(
            f"{'PASS' if check.passed else 'FAIL'} {check.name} [{check.dataset}]: {check.value:.3g} "
            f"(target {check.target:g}) {check.detail}"
        )
    print("wrote " + ", ".join(str(p) for p in written))
    if run.violations:
        print(
            f"diffdraft: error: LOSSLESS CHECK FAILED: {len(run.violations)} outputs diverge from plain AR "
            f"at a clear float32 margin (see 'Divergences' in {Path(args.out) / 'report.md'})",
            file=sys.stderr,
        )
        return 1
    return 0


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in _split(text)]
    except ValueError as error:
        raise InvalidRequestError(f"--batch-sizes must be whole numbers, e.g. 1,2,4,8: {error}") from error
    if not sizes or min(sizes) < 1:
        raise InvalidRequestError(f"--batch-sizes must be at least 1, got {text!r}")
    return sorted(set(sizes))


def _run_batch_bench(
    args: argparse.Namespace, models: BenchModels, options: dict, batch_sizes: list[int], started: float
) -> int:
    """``--batch-sizes``: whole-batch throughput of our methods (first turns of the samples, greedy)."""
    from diffdraft.bench.batching import measure_batch_verify_cost, run_batch_benchmark, write_batch_outputs

    runners = _build_runners(models, options["methods"], explicit=True)
    foreign = [r.spec.label for r in runners if not isinstance(r, OursRunner)]
    if foreign:
        raise InvalidRequestError(
            f"--batch-sizes measures diffdraft's own methods; drop {', '.join(foreign)} from --methods"
        )
    samples = [s for name in options["datasets"] for s in load_samples(name, options["samples"])]
    prompts = [encode_turn(models.tokenizer, sample, sample.messages) for sample in samples]
    tolerance = args.tie_tolerance
    if tolerance is None:
        tolerance = TIE_TOLERANCE[models.main.model.dtype]
    checker = LosslessChecker(lambda: models.target("float32", optimized=False).model, tolerance)
    progress = not args.no_progress
    points = run_batch_benchmark(
        runners, prompts, batch_sizes, options["max_new_tokens"], options["repeats"], checker, progress
    )
    cost = measure_batch_verify_cost(runners[0].generator.target, batch_sizes)
    machine = _machine(models)
    header = {
        "command": _command(args, options),
        "machine": f"{machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads, "
        f"{models.dtype_name}",
        "prompts": len(prompts),
        "max_new_tokens": options["max_new_tokens"],
        "repeats": options["repeats"],
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "elapsed_seconds": time.time() - started,
    }
    written = write_batch_outputs(args.out, header, points, cost)
    for point in points:
        print(
            f"{point.method:>16} batch {point.batch_size}: {point.tokens_per_second:6.1f} tok/s, "
            f"tau {point.tau:.2f}, {point.violations} unexplained divergences"
        )
    print("wrote " + ", ".join(str(p) for p in written))
    if any(point.violations for point in points):
        print(
            "diffdraft: error: LOSSLESS CHECK FAILED in the batch benchmark (see batch.md)", file=sys.stderr
        )
        return 1
    return 0


def _resolve(args: argparse.Namespace) -> dict:
    """Explicit flags, else the --quick or full defaults."""
    defaults = QUICK if args.quick else FULL

    def pick(name: str):
        value = getattr(args, name)
        return defaults[name] if value is None else value

    budgets = _split(pick("budgets"))
    if args.methods is None:
        specs = default_specs(budgets)
    else:
        specs = []
        for text in _split(args.methods):
            spec = MethodSpec.parse(text)
            expand = spec.name == "ddtree" and spec.arg is None
            specs += [MethodSpec(spec.name, b, spec.dtype) for b in budgets] if expand else [spec]
    if MethodSpec(REFERENCE) not in specs:
        specs.insert(0, MethodSpec(REFERENCE))
    try:
        temperatures = [float(t) for t in _split(args.temperatures)]
    except ValueError as error:
        raise InvalidRequestError(f"--temperatures must be numbers, e.g. 0,0.7: {error}") from error
    for name in ("samples", "max_new_tokens", "repeats"):
        if pick(name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    return {
        "methods": list(dict.fromkeys(specs)),
        "datasets": _split(pick("datasets")),
        "samples": pick("samples"),
        "max_new_tokens": pick("max_new_tokens"),
        "repeats": pick("repeats"),
        "budgets": budgets,
        "temperatures": temperatures,
    }


def _ngram(args: argparse.Namespace) -> str:
    """The dart tree's trie: as given, else the default target's one with the default target."""
    if args.ngram is not None:
        return args.ngram
    return "default" if str(args.target) == "default" else "none"


def _deer_drafter(args: argparse.Namespace) -> str | None:
    """The DEER drafter: as given, else the shipped one with the default target (the methods of a
    drafter not shipped yet are skipped, unless named in --methods)."""
    if args.deer_drafter is not None:
        return args.deer_drafter
    return "default-deer" if str(args.target) == "default" else None


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _build_runners(models: BenchModels, specs: list[MethodSpec], explicit: bool) -> list:
    runners = []
    for spec in specs:
        try:
            runners.append(build_method(models, spec))
        except MethodUnavailable as error:
            if explicit and spec != MethodSpec(REFERENCE):
                raise
            print(f"diffdraft bench: skipping {spec.label}: {error}", file=sys.stderr)
    return runners


def _median_context(records: list[Record], method: str) -> int:
    """The typical number of cached tokens a method's rounds verified over in this run."""
    contexts = [n for r in records if r.method == method for n in r.completion.verify_contexts]
    return int(np.median(contexts)) if contexts else 0


def _command(args: argparse.Namespace, options: dict) -> str:
    """The command that reproduces this run, every resolved option spelled out."""
    parts = ["diffdraft", "bench", "--target", str(args.target), "--dtype", args.dtype]
    for flag, value in (
        ("--drafter", args.drafter),
        ("--dart-drafter", args.dart_drafter),
        ("--ngram", _ngram(args) if args.dart_drafter else None),
        ("--deer-drafter", _deer_drafter(args)),
        ("--assistant", args.assistant),
        ("--device", args.device),
    ):
        if value is not None:
            parts += [flag, str(value)]
    parts += ["--methods", ",".join(s.label for s in options["methods"])]
    parts += ["--datasets", ",".join(options["datasets"]), "--samples", str(options["samples"])]
    parts += ["--max-new-tokens", str(options["max_new_tokens"]), "--repeats", str(options["repeats"])]
    parts += ["--temperatures", ",".join(f"{t:g}" for t in options["temperatures"]), "--seed", str(args.seed)]
    parts += ["--warmup-tokens", str(args.warmup_tokens)]
    for flag, value in (("--tie-tolerance", args.tie_tolerance), ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    if args.batch_sizes is not None:
        parts += ["--batch-sizes", args.batch_sizes]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def _machine(models: BenchModels) -> dict:
    """What timings depend on besides the command."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": str(models.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _environment(models: BenchModels, busy_before: float | None) -> dict:
    return _machine(models) | {
        "busy_before": busy_before,
        "busy_after": _cpu_busy(),
        "load_average": _load_average(),
    }


def _cpu_busy(seconds: float = 0.5) -> float | None:
    """Share of all cores busy over ``seconds`` while this process idles: other jobs on the machine.

    On a small machine another torch process makes timings meaningless (two processes with a
    thread per core each slow each other down many times over), so the report says so.
    """
    try:
        first = _cpu_times()
        time.sleep(seconds)
        second = _cpu_times()
    except (OSError, ValueError):
        return None
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])
    return 1.0 - idle / total if total > 0 else None


def _cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(x) for x in stat.readline().split()[1:]]


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
