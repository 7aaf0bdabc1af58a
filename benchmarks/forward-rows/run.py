"""How a target forward's time grows with the tokens it verifies, and where it goes, on this CPU.

For each cached context length and each row count k, times one forward of a k-token chain (what a
speculative round verifies) through the target's real path, then again op by op with every stage
timed on its own: the four projections of a layer, the LM head, attention over the cache, rotary,
norms, gating, the embedding, and the rest (Python, views, cache bookkeeping). A forward of k tokens
reads the weights once and adds k tokens of multiply-adds, so its time should grow far slower than k;
the table's ``x 1 row`` column says how far it does.

    python benchmarks/forward-rows/run.py --target default --rows 1 2 4 8 9 16 32 --context 256 2048 \\
        --out benchmarks/forward-rows/results-avx512

The kernels' build is this CPU's widest unless ``DIFFDRAFT_KERNEL_ISA`` asks for a narrower one
(:mod:`diffdraft.kernels.quantized.kernel_build`); ``ONEDNN_MAX_CPU_ISA`` and ``ATEN_CPU_CAPABILITY``
narrow torch's own. The output records which ran, with the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from diffdraft.bench.machine import cpu_description
from diffdraft.kernels.quantized.kernel_build import instruction_set
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees.tree import DraftTree

OP_STAGES = {
    "rms_norm": "norms",
    "residual_rms_norm": "norms",
    "normed_residual_rms_norm": "norms",
    "rotary_split": "rotary",
    "attend_cached": "attention",
    "attention": "attention",
    "silu_gate": "gate",
    "gelu_tanh_gate": "gate",
}
"""The fused decoder ops (decoder_ops.cpp) by the stage they are counted in."""
LINEAR_STAGES = {"qkv": "qkv", "output": "o", "gate_up": "gate_up", "down": "down"}
"""A fused layer's linears (decoder_ops._Layer's fields) by stage."""
STAGES = ["embed", "qkv", "rotary", "attention", "o", "norms", "gate_up", "gate", "down", "head", "rest"]
clock: Callable[[], float] = time.perf_counter
"""What every time is read with (``--clock``)."""


def timed(function: Callable, totals: dict[str, float], stage: str) -> Callable:
    def call(*args, **kwargs):
        begin = clock()
        out = function(*args, **kwargs)
        totals[stage] += clock() - begin
        return out

    return call


class TimedOps:
    """The fused ops with each call's time added to its stage."""

    def __init__(self, ops: object, totals: dict[str, float]) -> None:
        self._ops, self._totals = ops, totals

    def __getattr__(self, name: str) -> Callable:
        return timed(getattr(self._ops, name), self._totals, OP_STAGES.get(name, "rest"))


@contextmanager
def stages_timed(target: TargetModel) -> Iterator[dict[str, float]]:
    """Within it, the target's forward runs op by op (the fused layers' Python loop, not their one-op
    loop), every stage timed; the yielded dict sums each stage's seconds."""
    lean = target.lean
    fused = lean.fused if lean is not None else None
    if fused is None:
        raise SystemExit("stage times need a target on the fused block layers (a GGUF target, bfloat16)")
    totals: dict[str, float] = defaultdict(float)
    model = target.model
    modules = [(model.lm_head, "head"), (lean.decoder.embed_tokens, "embed")]
    for layer in fused.layers:
        modules += [(getattr(layer, field), stage) for field, stage in LINEAR_STAGES.items()]
    with ExitStack() as undo:
        for module, stage in modules:
            module.forward = timed(type(module).forward.__get__(module), totals, stage)
            undo.callback(delattr, module, "forward")
        stack, ops = fused.stack, fused.ops
        fused.stack, fused.ops = None, TimedOps(ops, totals)
        undo.callback(setattr, fused, "stack", stack)
        undo.callback(setattr, fused, "ops", ops)
        yield totals


def profile(target: TargetModel, context: int, rows: list[int], repeats: int) -> list[dict]:
    """Per row count: the median ms of the real forward, and of each stage in the op-by-op one."""
    generator = torch.Generator().manual_seed(context)
    ids = torch.randint(0, target.vocab_size, (context + max(rows),), generator=generator)
    cache = target.new_cache()
    target.prefill(cache, ids[:context], [])
    results = []
    for k in rows:
        tokens = ids[context : context + k]
        tree = DraftTree(tokens, torch.arange(-1, k - 1), torch.arange(k))
        mask = target.attention_mask(cache, tree.ancestor_mask()) if k > 1 else None
        positions = tree.position_ids(context)

        def forward(tokens=tokens, positions=positions, mask=mask, k=k) -> None:
            target.verify(cache, tokens, positions, mask, [])
            cache.crop(-k)

        for _ in range(3):
            forward()
        whole = []
        for _ in range(repeats):
            begin = clock()
            forward()
            whole.append(clock() - begin)
        by_stage: dict[str, list[float]] = defaultdict(list)
        with stages_timed(target) as totals:
            forward()
            for _ in range(repeats):
                totals.clear()
                begin = clock()
                forward()
                wall = clock() - begin
                for stage in STAGES[:-1]:
                    by_stage[stage].append(totals.get(stage, 0.0))
                by_stage["rest"].append(wall - sum(totals.values()))
                by_stage["op by op"].append(wall)
        row = {"rows": k, "ms": 1e3 * statistics.median(whole)}
        row["stages_ms"] = {stage: 1e3 * statistics.median(times) for stage, times in by_stage.items()}
        results.append(row)
        print(f"context {context}, {k} rows: {row['ms']:.2f} ms", flush=True)
    return results


def write_report(result: dict, out: Path) -> None:
    """report.md (a table per context) and rows.png (ms against rows, whole forward and stages)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = result["machine"]
    flags = ", ".join(flag for flag, present in cpu["cpu"]["flags"].items() if present)
    lines = [
        f"# Forward time against rows: {result['target']}",
        "",
        f"CPU: {cpu['cpu']['model']} ({flags}); kernels built for `{cpu['kernel_build']}`, torch's "
        f"capability {cpu['torch_capability']}, oneDNN ISA cap {cpu['onednn_max_isa'] or 'none'}, "
        f"{result['threads']} threads, {result['command']['clock']} clock. "
        f"Median of {result['command']['repeats']} forwards each.",
        "",
        "`ms`: the real forward (the fused layers' one-op loop). The stage columns come from the same "
        "forward run op by op with each stage timed (`op by op` is its whole time).",
        "",
    ]
    figure, axes = plt.subplots(1, len(result["contexts"]), figsize=(6 * len(result["contexts"]), 4.5))
    axes = [axes] if len(result["contexts"]) == 1 else axes
    for axis, (context, rows) in zip(axes, result["contexts"].items(), strict=True):
        one = rows[0]["ms"]
        header = ["rows", "ms", "x 1 row", "op by op", *STAGES]
        lines += [f"## Context {context}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [str(row["rows"]), f"{row['ms']:.2f}", f"{row['ms'] / one:.2f}"]
            cells += [f"{row['stages_ms'][stage]:.2f}" for stage in ["op by op", *STAGES]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        counts = [row["rows"] for row in rows]
        axis.plot(counts, [row["ms"] for row in rows], "k-o", label="whole forward", linewidth=2)
        for stage in STAGES:
            axis.plot(counts, [row["stages_ms"][stage] for row in rows], "-", label=stage, alpha=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("rows verified")
        axis.set_ylabel("ms")
        axis.set_title(f"context {context}")
        axis.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, ncol=2)
    figure.suptitle(f"{result['target']} on {cpu['kernel_build']}")
    figure.tight_layout()
    figure.savefig(out / "rows.png", dpi=110)
    (out / "report.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default", help="'default' or a GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 9, 16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 2048], help="cached tokens")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (with --threads 1, near what a quiet machine's wall clock reads "
        "while other work shares this one; never for a committed run)",
    )
    parser.add_argument("--out", type=Path, default=Path("forward-profile"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        global clock
        clock = time.process_time
    target = TargetModel(load_target(args.target, dtype="bfloat16", optimize=True).model)
    rows = sorted(set(args.rows))
    contexts = {context: profile(target, context, rows, args.repeats) for context in args.context}
    result = {
        "command": vars(args) | {"out": str(args.out)},
        "target": str(args.target),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": {
            "cpu": cpu_description(),
            "kernel_build": instruction_set(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        },
        "contexts": contexts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result, args.out)
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
