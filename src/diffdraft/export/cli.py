"""``diffdraft export DRAFTER --format vllm|sglang|llama.cpp --out PATH``: a DFlash, DFlash2 or DSpark
drafter as vLLM or SGLang (a directory) or llama.cpp (one GGUF file, ``--target TARGET.gguf``
required) loads it."""

from __future__ import annotations

import argparse
from pathlib import Path

from diffdraft.export.exporter import ENGINES, export_drafter
from diffdraft.export.llamacpp import FORMAT as LLAMACPP
from diffdraft.export.llamacpp import target_file
from diffdraft.target.loading import default_model_dir

TARGET_PLACEHOLDER = "TARGET"
"""Stands for the target's path in the printed launch command when --target is not given."""


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a DFlash, DFlash2 or DSpark drafter as vLLM, SGLang (a directory) or llama.cpp (one "
        "GGUF file) loads it for their speculative decoding",
    )
    parser.add_argument(
        "drafter", help="DFlash, DFlash2 or DSpark checkpoint directory, or a shipped drafter name"
    )
    parser.add_argument("--format", required=True, choices=sorted(ENGINES), help="the serving engine")
    parser.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="directory to write (vllm, sglang), or the .gguf file to write (llama.cpp, e.g. drafter.gguf)",
    )
    parser.add_argument("--force", action="store_true", help="replace whatever --out holds")
    parser.add_argument(
        "--target",
        default=None,
        metavar="MODEL",
        help="the target the drafter serves (directory, .gguf or 'default'): checks the drafter fits it; "
        "needed for vLLM when the drafter has a draft vocabulary (its LM head rows are exported); "
        "llama.cpp needs it always, as the .gguf it serves (the draft GGUF takes its tokenizer)",
    )
    parser.add_argument(
        "--full-vocabulary",
        action="store_true",
        help="drop the drafter's draft vocabulary, so it drafts over the target's whole vocabulary "
        "(SGLang cannot restrict it; acceptance can change: measure it with `diffdraft train eval`)",
    )
    return parser


def run_export(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    export = export_drafter(args.drafter, args.format, out, args.force, args.target, args.full_vocabulary)
    engine = ENGINES[args.format]
    config = export.config
    taps = (config.get("dflash_config") or config)["target_layer_ids"]  # DSpark keeps them at the top
    print(
        f"wrote {out}: {config['architectures'][0]} for {engine.name}, {config['num_hidden_layers']} layers, "
        f"block size {config['block_size']}, target layers {taps}",
        flush=True,
    )
    served, note = gguf_launch_target(args.target) if args.format == LLAMACPP else launch_target(args.target)
    print(f"launch: {engine.launch(out.resolve(), config, served)}")
    if engine.other_launch is not None:
        print(f"  {engine.other_launch(out.resolve(), config, served)}")
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
        converted = default_model_dir()
        return str(converted), "the default target, as the Hugging Face directory diffdraft converted"
    return str(Path(target).expanduser().resolve()), "the target given with --target"


def gguf_launch_target(target: str) -> tuple[str, str]:
    """llama.cpp serves the target's GGUF: the file given with --target ('default': diffdraft's)."""
    path = str(target_file(target).resolve())
    if target == "default":
        return path, "the default target's GGUF file"
    return path, "the target GGUF given with --target"
