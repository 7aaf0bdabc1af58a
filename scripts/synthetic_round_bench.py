"""Time one speculative round per stage on random-weight models of real shapes (issue 31, item 2).

    python scripts/synthetic_round_bench.py --device cuda --shape qwen3-8b --repeats 3 --profile
    python scripts/synthetic_round_bench.py --device cuda --shape qwen3-8b --acceptance full
    python scripts/synthetic_round_bench.py --device cpu --shape small --threads 2
    python scripts/synthetic_round_bench.py --device cpu --shape tiny          # seconds: a smoke test

No downloads: the target is a random Qwen3 built from a config in code on the chosen device (the 8B
shape never touches the host), the drafter a random DFlash of the official shape. Times plain
decoding, the chain and DDTree at each budget, and the official ``dflash`` package's generation loop
on the same weights and prompt when the package is installed. Writes results.json, report.md and
round_stages.png (and profile.md with --profile) under --out; see :mod:`diffdraft.bench.synthetic`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from diffdraft.bench.synthetic import ACCEPTANCE, DTYPES, SHAPES, Settings, run_benchmark
from diffdraft.bench.synthetic_report import write_outputs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--budgets", default="8,16,32,64", help="DDTree node budgets, comma-separated")
    parser.add_argument("--context", type=int, help="prompt tokens (default: the shape's)")
    parser.add_argument("--rounds", type=int, default=32, help="timed rounds per method and repeat")
    parser.add_argument("--warmup", type=int, default=4, help="untimed rounds before them")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved passes over the methods")
    regimes = "; ".join(f"{name}: {text}" for name, text in ACCEPTANCE.items())
    parser.add_argument("--acceptance", choices=sorted(ACCEPTANCE), default="random", help=regimes)
    parser.add_argument("--no-official", action="store_true", help="skip the dflash package's loop")
    parser.add_argument("--cuda-graphs", action="store_true", help="verify through CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="also write profile.md (syncs, copies)")
    parser.add_argument(
        "--sdpa-backends",
        default="",
        help="comma-separated attention backends every loop may use (flash_attention, efficient_attention, "
        "math, cudnn_attention, overrideable); default: torch's choice",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="default: bench-results/synthetic-SHAPE-DEVICE-ACCEPTANCE")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = Settings(
        shape=args.shape,
        device=args.device,
        dtype=args.dtype,
        budgets=tuple(int(b) for b in args.budgets.split(",") if b),
        context=args.context,
        rounds=args.rounds,
        warmup=args.warmup,
        repeats=args.repeats,
        acceptance=args.acceptance,
        official=not args.no_official,
        profile=args.profile,
        cuda_graphs=args.cuda_graphs,
        sdpa_backends=tuple(name for name in args.sdpa_backends.split(",") if name),
        seed=args.seed,
    )
    command = shlex.join(["python", f"scripts/{Path(__file__).name}", *argv])
    results = run_benchmark(settings, command, log=lambda line: print(f"[synthetic] {line}", flush=True))
    device = torch.device(args.device).type
    out = args.out or f"bench-results/synthetic-{args.shape}-{device}-{args.acceptance}"
    for path in write_outputs(results, out):
        print(f"[synthetic] wrote {path}", flush=True)
    return results


if __name__ == "__main__":
    main()
