"""Controlled drafter-recipe experiments: one change at a time against a base recipe.

Every arm trains with the same command (``diffdraft train fit``: same steps, batch, learning rate
and seed) on the same number of sequences, changing one thing, and is measured by
``diffdraft train eval`` on the same held-out file (teacher-forced accuracy and agreement with the
target per block position, tau from real greedy decoding). Arms run as parallel processes.

    python scripts/drafter_ablation.py --answers regenerated.jsonl --replies replies.jsonl \\
        --held-out heldout.jsonl --out ablation --steps 300 --device cuda --parallel 8

writes ``ablation/<arm>/`` (run directory, logs, eval.json), ``ablation/results.json`` and
``ablation/table.md``. ``--answers`` holds the target's own answers (``train regenerate``),
``--replies`` the data's own replies (``train regenerate --source-replies``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

BASE_RECIPE = [
    "--variant", "dflare", "--num-layers", "2", "--block-size", "8", "--draft-vocab-size", "16384",
    "--labels", "target", "--init-layers", "random",
]  # fmt: skip
ORACLE_SEQUENCES = 8


@dataclass
class Arm:
    name: str
    change: str
    data: str
    """"answers", "replies" or "oracle" (the first few answers, evaluated on themselves)."""
    flags: list[str] = field(default_factory=list)


ARMS = [
    Arm("replies-tokens", "v1-v3 recipe: the data's replies, cross-entropy on their tokens", "replies",
        ["--labels", "tokens"]),
    Arm("answers-tokens", "the target's own answers, cross-entropy on their tokens", "answers",
        ["--labels", "tokens"]),
    Arm("base", "the target's own answers, distilled (KL to the target at every position)", "answers"),
    Arm("replies-distilled", "the data's replies, distilled", "replies"),
    Arm("target-init", "base + draft layers copied from the target's last 2 layers", "answers",
        ["--init-layers", "target"]),
    Arm("layers-1", "base with 1 draft layer", "answers", ["--num-layers", "1"]),
    Arm("layers-4", "base with 4 draft layers", "answers", ["--num-layers", "4"]),
    Arm("block-4", "base with block size 4", "answers", ["--block-size", "4"]),
    Arm("block-16", "base with block size 16", "answers", ["--block-size", "16"]),
    Arm("dense-anchors", "base with every response position an anchor (base: one per 6 tokens)",
        "answers", ["--anchors-per-sequence", "100000"]),
    Arm("oracle-overfit", f"sanity: base trained on {ORACLE_SEQUENCES} sequences, evaluated on them",
        "oracle"),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answers", required=True, help="the target's own answers (train regenerate)")
    parser.add_argument("--replies", required=True, help="the data's replies (regenerate --source-replies)")
    parser.add_argument("--held-out", required=True, help="held-out samples, all used for eval")
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--device", default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=32, help="greedy tokens per held-out prompt")
    parser.add_argument("--parallel", type=int, default=1, help="arms trained at once")
    parser.add_argument("--arms", nargs="+", default=None, help="run only these arms")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [arm for arm in ARMS if args.arms is None or arm.name in args.arms]
    sequences = args.steps * args.batch_size
    data = {
        "answers": first_lines(Path(args.answers), sequences, out / "answers.jsonl"),
        "replies": first_lines(Path(args.replies), sequences, out / "replies.jsonl"),
        "oracle": first_lines(Path(args.answers), ORACLE_SEQUENCES, out / "oracle.jsonl"),
    }
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda arm: run_arm(arm, data, args, out), arms))
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "table.md").write_text(table(results))
    print(table(results))


def first_lines(source: Path, count: int, destination: Path) -> Path:
    """The same first ``count`` samples for every arm (a file still being written is cut at a line)."""
    with source.open() as lines, destination.open("w") as out:
        for written, line in enumerate(lines):
            if written == count or not line.endswith("\n"):
                break
            out.write(line)
    return destination


def run_arm(arm: Arm, data: dict[str, Path], args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / arm.name
    device = ["--device", args.device] if args.device else []
    common = ["--target", args.target, "--max-length", str(args.max_length), *device]
    fit = [
        sys.executable, "-m", "diffdraft.cli", "train", "fit", "--data", str(data[arm.data]),
        "--output-dir", str(run_dir), "--held-out", "0", "--dtype", "bfloat16",
        "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--save-every", str(args.steps),
        "--learning-rate", "6e-4", "--seed", "0", "--compute-dtype", "bfloat16",
        *common, *BASE_RECIPE, *arm.flags,
    ]  # fmt: skip
    eval_data = data["oracle"] if arm.data == "oracle" else Path(args.held_out)
    evaluate = [
        sys.executable, "-m", "diffdraft.cli", "train", "eval", "--data", str(eval_data),
        "--held-out", str(count_lines(eval_data)), "--drafter", str(run_dir / "final"),
        "--budgets", "8", "32", "--max-new-tokens", str(args.eval_tokens), "--dtype", "float32",
        "--out", str(run_dir / "eval.json"), *common,
    ]  # fmt: skip
    record = {"arm": arm.name, "change": arm.change, "fit": fit, "eval": evaluate}
    begin = time.perf_counter()
    for name, command in (("fit", fit), ("eval", evaluate)):
        with (out / f"{arm.name}.{name}.log").open("w") as log:
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
        if code:
            record["error"] = f"{name} exited with {code}; see {arm.name}.{name}.log"
            print(f"{arm.name}: {record['error']}", flush=True)
            return record
    record["result"] = json.loads((run_dir / "eval.json").read_text())
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    record["seconds_per_step"] = last["elapsed_seconds"] / last["step"]
    record["tokens_seen"] = last["tokens_seen"]
    print(f"{arm.name}: done in {time.perf_counter() - begin:.0f} s", flush=True)
    return record


def count_lines(path: Path) -> int:
    with path.open() as lines:
        return sum(1 for line in lines if line.strip())


def table(results: list[dict]) -> str:
    rows = [
        "| arm | change | acc 1 | acc 2 | acc 4 | agree 1 | agree 2 | agree 4 | tau chain | tau DDTree-8 "
        "| tau DDTree-32 | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record in results:
        if "result" not in record:
            rows.append(f"| {record['arm']} | {record['change']} | {record['error']} |" + " |" * 9)
            continue
        r = record["result"]

        def at(values: list[float], position: int) -> str:
            return f"{values[position - 1]:.3f}" if len(values) >= position else "-"

        acc, agree, tau = r["accuracy_by_position"], r["agreement_by_position"], r["tau"]
        rows.append(
            f"| {record['arm']} | {record['change']} | {at(acc, 1)} | {at(acc, 2)} | {at(acc, 4)} "
            f"| {at(agree, 1)} | {at(agree, 2)} | {at(agree, 4)} | {tau['chain']:.2f} "
            f"| {tau['ddtree-8']:.2f} | {tau['ddtree-32']:.2f} | {record['seconds_per_step']:.2f} |"
        )
    held_out = [r for r in results if "result" in r and r["arm"] != "oracle-overfit"]
    ceiling = held_out[0]["result"]["target_accuracy"] if held_out else None
    if ceiling is not None:
        rows.append(
            f"\nThe target's own teacher-forced accuracy on the held-out text (the ceiling of 'acc'): "
            f"{ceiling:.3f}."
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
