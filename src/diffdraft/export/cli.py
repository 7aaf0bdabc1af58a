"""``diffdraft export DRAFTER --format vllm|sglang --out DIR``: a drafter as vLLM or SGLang loads it."""

from __future__ import annotations

import argparse
from pathlib import Path

from diffdraft.export.exporter import ENGINES, export_drafter
from diffdraft.target.loading import default_model_dir

TARGET_PLACEHOLDER = "TARGET"
"""Stands for the target's path in the printed launch command when --target is not given."""


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export", help="write a DFlash drafter as vLLM or SGLang loads it (their DFlash speculative decoding)"
    )
    parser.add_argument("drafter", help="DFlash checkpoint directory, or a shipped drafter name")
    parser.add_argument("--format", required=True, choices=sorted(ENGINES), help="the serving engine")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    parser.add_argument("--force", action="store_true", help="replace whatever --out holds")
    parser.add_argument(
        "--target",
        default=None,
        metavar="MODEL",
        help="the target the drafter serves (directory, .gguf or 'default'): checks the drafter fits it; "
        "needed for vLLM when the drafter has a draft vocabulary (its LM head rows are exported)",
    )
    return parser


def run_export(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    export = export_drafter(args.drafter, args.format, out, args.force, args.target)
    engine = ENGINES[args.format]
    config = export.config
    print(
        f"wrote {out}: DFlash drafter for {engine.name}, {config['num_hidden_layers']} layers, block size "
        f"{config['block_size']}, target layers {config['dflash_config']['target_layer_ids']}",
        flush=True,
    )
    served, note = launch_target(args.target)
    print(f"launch: {engine.launch(out.resolve(), config['block_size'], served)}")
    print(f"  ({note})")
    return 0


def launch_target(target: str | None) -> tuple[str, str]:
    """The model path the launch command serves, and a line saying what it is: engines open a
    directory or hub id, not diffdraft's name 'default' (its Hugging Face conversion is a directory)."""
    if target is None:
        return TARGET_PLACEHOLDER, (
            f"{TARGET_PLACEHOLDER}: the target's Hugging Face directory or hub id, the model the drafter "
            "was trained on; pass --target to have it filled in"
        )
    if target == "default":
        return str(
            default_model_dir()
        ), "the default target, as the Hugging Face directory diffdraft converted"
    return str(Path(target).expanduser().resolve()), "the target given with --target"
