"""Prompt lookup with copies sized by what verifying costs, against whole copies and plain decoding.

``pld`` verifies as much of each copy as it expects to pay for: every copied token is kept with the
generation's own calibrated rate for its match length and depth, and costs its share of the
verification forward (the auto budget's probed curve). Before, every round verified the whole copy
(up to 10 tokens), whatever it kept. This run decodes the same prompts with ``ar``, ``pld`` (sized)
and ``pld`` with whole copies, interleaved prompt by prompt so drift hits all three alike, checks
that both ``pld`` runs are token-identical to ``ar``, and reports median decode tokens per second,
tau and tokens verified per round.

    python benchmarks/pld-copy-length/run.py --target default --samples 6 --max-new-tokens 128 \\
        --out benchmarks/pld-copy-length/results-avx512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

import diffdraft
from diffdraft.bench.datasets import load_samples
from diffdraft.bench.machine import cpu_description
from diffdraft.kernels.quantized.kernel_build import instruction_set

METHODS = ("ar", "pld", "pld whole")
NARROWING = ("DIFFDRAFT_KERNEL_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""The variables that make a wide CPU run a narrower build's paths (benchmarks/forward-rows/README.md)."""


def decode(generator: diffdraft.SpeculativeGenerator, sample, max_new_tokens: int) -> dict:
    """One greedy generation's tokens and figures (decode speed leaves the prefill out)."""
    request = {"messages": sample.messages} if sample.messages else {"prompt": sample.prompt}
    result = generator.generate(**request, max_new_tokens=max_new_tokens)
    stats = result.stats
    decode_seconds = stats.total_seconds - stats.timings.get("prefill", 0.0)
    verified = sum(stats.tree_sizes) + stats.rounds
    return {
        "tokens": result.token_ids,
        "tok_s": len(result.token_ids) / decode_seconds,
        "tau": stats.tau,
        "verified_per_round": verified / max(1, stats.rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--samples", type=int, default=6, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = diffdraft.load(target=args.target, method="ar")
    sized = diffdraft.SpeculativeGenerator(plain.loaded, "pld")
    whole = diffdraft.SpeculativeGenerator(plain.loaded, "pld")
    whole.drafter.verify_seconds = None  # the copies of before: verified whole
    generators = dict(zip(METHODS, (plain, sized, whole), strict=True))
    rows = {}
    for dataset in args.datasets:
        samples = load_samples(dataset, args.samples)
        runs = {method: [] for method in METHODS}
        identical = {method: 0 for method in METHODS[1:]}
        for sample in samples:
            decode(plain, sample, 16)  # warm-up
            medians = {}
            for method in METHODS:
                repeats = [
                    decode(generators[method], sample, args.max_new_tokens) for _ in range(args.repeats)
                ]
                medians[method] = repeats[len(repeats) // 2] | {
                    "tok_s": statistics.median(r["tok_s"] for r in repeats)
                }
            for method in METHODS[1:]:
                identical[method] += medians[method]["tokens"] == medians["ar"]["tokens"]
            for method in METHODS:
                runs[method].append({k: v for k, v in medians[method].items() if k != "tokens"})
            print(dataset, sample.id, {m: round(medians[m]["tok_s"], 1) for m in METHODS}, flush=True)
        rows[dataset] = {
            method: {
                "tok_s": statistics.median(r["tok_s"] for r in runs[method]),
                "tau": statistics.mean(r["tau"] for r in runs[method]),
                "verified_per_round": statistics.mean(r["verified_per_round"] for r in runs[method]),
                "identical_to_ar": identical.get(method, len(samples)),
                "samples": len(samples),
            }
            for method in METHODS
        }
    result = {
        "command": vars(args) | {"out": str(args.out)},
        "machine": {
            "cpu": cpu_description(),
            "kernel_build": instruction_set(),
            "threads": args.threads,
            "narrowed": {name: os.environ[name] for name in NARROWING if name in os.environ},
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "| dataset | method | tok/s | x ar | tau | verified / round | identical to ar |",
        "|---|---|---|---|---|---|---|",
    ]
    for dataset, by_method in rows.items():
        for method, row in by_method.items():
            speedup = row["tok_s"] / by_method["ar"]["tok_s"]
            identical = f"{row['identical_to_ar']}/{row['samples']}"
            lines.append(
                f"| {dataset} | {method} | {row['tok_s']:.1f} | {speedup:.2f} | {row['tau']:.2f} | "
                f"{row['verified_per_round']:.2f} | {identical} |"
            )
    flags = ", ".join(flag for flag, present in result["machine"]["cpu"]["flags"].items() if present)
    model = result["machine"]["cpu"]["model"]
    header = f"CPU: {model} ({flags}); kernels `{instruction_set()}`, {args.threads} threads\n\n"
    (args.out / "report.md").write_text(header + "\n".join(lines) + "\n")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
