"""Device-side helpers of a GPU lease's training call (``device.sh`` runs them; see README.md).

python3 scripts/gpu_lease/device.py convert GGUF DIR            # the target as a safetensors dir, once
python3 scripts/gpu_lease/device.py steps PROBE_DIR MINUTES     # optimizer steps that fit MINUTES
python3 scripts/gpu_lease/device.py export RUN_DIR DRAFTER_DIR  # latest checkpoint, bf16, for $OUT
python3 scripts/gpu_lease/device.py summary RUN_DIR PROBE_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.target.loading import load_target
from diffdraft.train.run_checkpoints import latest_checkpoint
from diffdraft.train.trainer import METRICS_FILE

SKIPPED_STEPS = 3
"""Probe steps left out of the rate: the first ones pay CUDA's warm-up (kernel choice, allocator)."""
SAFETY = 0.8
"""Scheduled steps are this share of what the probe's rate allows, so the cosine schedule ends (the
learning rate near zero) before ``--max-minutes`` would cut the run mid-schedule: on a lent H100 the
run's own rate, checkpoints and exports included, was 0.83x the probe's (138 vs 167 K tokens/s)."""


def convert(gguf: Path, out: Path) -> None:
    """Dequantize once, as the default target's cache is made: each later load then takes a second,
    not the GGUF's ~15 s, and has the tokenizer the packed data was made with."""
    loaded = load_target(gguf, dtype="float32", device="cpu")
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines() if line.strip()]


def rate(rows: list[dict]) -> tuple[float, float]:
    """(training tokens/s, tokens per step) between the first counted step and the last."""
    first, last = rows[0], rows[-1]
    seconds = last["elapsed_seconds"] - first["elapsed_seconds"]
    tokens = last["tokens_seen"] - first["tokens_seen"]
    steps = last["step"] - first["step"]
    if seconds <= 0 or steps <= 0:
        raise SystemExit("device: too few measured steps for a rate; give the probe more steps")
    return tokens / seconds, tokens / steps


def steps_for(probe: Path, minutes: float) -> int:
    tokens_per_second, tokens_per_step = rate(metrics(probe)[SKIPPED_STEPS:])
    return max(1, int(SAFETY * minutes * 60 * tokens_per_second / tokens_per_step))


def export(run: Path, out: Path) -> str | None:
    """The run's final drafter, else its latest checkpoint, saved in bfloat16 as drafters ship
    (15 MB: the float32 checkpoints with their optimizer state are too big to come back)."""
    source = run / "final" if (run / "final").is_dir() else latest_checkpoint(run)
    if source is None:
        return None
    staged = run.parent / "export.tmp"  # beside the run, not in $OUT: a kill there would send it back
    shutil.rmtree(staged, ignore_errors=True)
    save_draft_model(load_draft_model(source), staged, dtype=torch.bfloat16)
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(staged, out)
    return source.name


def summary(run: Path, probe: Path, out: Path) -> dict:
    """Measured speed and the held-out comparison against the shipped drafter, in one JSON."""
    rows = metrics(run)
    tokens_per_second, _ = rate(rows[SKIPPED_STEPS:])
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": rows[-1]["step"],
        "tokens_seen": rows[-1]["tokens_seen"],
        "training_seconds": rows[-1]["elapsed_seconds"],
        "tokens_per_second": tokens_per_second,
        "probe_tokens_per_second": rate(metrics(probe)[SKIPPED_STEPS:])[0],
        "final_loss": rows[-1]["loss"],
    }
    evaluations = {name: out / f"eval-{name}.json" for name in ("shipped", "new")}
    if all(path.is_file() for path in evaluations.values()):
        shipped, new = (json.loads(path.read_text()) for path in evaluations.values())
        first = {"shipped": shipped["accuracy_by_position"][0], "new": new["accuracy_by_position"][0]}
        taus = {name: {"shipped": shipped["tau"][name], "new": new["tau"][name]} for name in shipped["tau"]}
        result["held_out"] = {"accuracy_pos1": first, "tau": taus}
        result["new_is_better"] = first["new"] > first["shipped"] and all(
            tau["new"] >= tau["shipped"] for tau in taus.values()
        )
    return result


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    steps = parser.add_subparsers(dest="step", required=True)
    made = steps.add_parser("convert")
    made.add_argument("gguf", type=Path)
    made.add_argument("out", type=Path)
    fitted = steps.add_parser("steps")
    fitted.add_argument("probe", type=Path)
    fitted.add_argument("minutes", type=float)
    exported = steps.add_parser("export")
    exported.add_argument("run", type=Path)
    exported.add_argument("out", type=Path)
    summed = steps.add_parser("summary")
    summed.add_argument("run", type=Path)
    summed.add_argument("probe", type=Path)
    summed.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.step == "convert":
        convert(args.gguf, args.out)
    elif args.step == "steps":
        print(steps_for(args.probe, args.minutes))
    elif args.step == "export":
        print(f"device: exported {export(args.run, args.out) or 'nothing yet'} to {args.out}", flush=True)
    else:
        result = summary(args.run, args.probe, args.out)
        (args.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
