"""The options that choose what to load (target, drafter, method, budget, trie, dtype, device), shared
by ``diffdraft generate`` and ``diffdraft serve``: here, below both commands, so neither imports the
other for them."""

from __future__ import annotations

import argparse

from diffdraft.decoding.method_table import METHODS, TreeRule
from diffdraft.generator import SpeculativeGenerator, load
from diffdraft.trees.tree import MAX_TREE_NODES


def budget_argument(value: str) -> int | str:
    """``--budget``'s value, an integer from 1 to :data:`~diffdraft.trees.tree.MAX_TREE_NODES` (where
    a tree's verification grows past anything a round can gain) or 'auto': a bad one's error names
    both forms, before anything loads."""
    if value == "auto":
        return value
    try:
        budget = int(value)
    except ValueError:
        budget = None
    if budget is None or budget < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    if budget > MAX_TREE_NODES:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_TREE_NODES} nodes (a larger tree costs more to verify than any round can gain), "
            f"got {value!r}; pass e.g. 32, or 'auto'"
        )
    return budget


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that pick what :func:`load_generator` loads (shared by generate and serve)."""
    p.add_argument(
        "--target", default="default", help="model directory, .gguf file, or 'default' (SmolLM2-135M)"
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="DFlash/DFlare, DFlash2, DSpark, DART or DEER checkpoint directory, 'default' (DFlare), "
        "'default-dflash', 'default-dart', 'default-deer' or 'none' (default: the shipped drafter of the "
        "method with --target default, else none)",
    )
    p.add_argument("--method", choices=METHODS, default="ar", help="decoding method (default: ar)")
    p.add_argument(
        "--budget",
        type=budget_argument,
        default=None,
        help="DDTree node budget (ddtree, ddtree+pld, deer-tree), or 'auto' (their default) to pick it from "
        "this machine's verification cost (a few forwards timed once, then the rounds' own); for dart the "
        f"tree size (default: 32); at most {MAX_TREE_NODES}: a round verifies its whole tree in one "
        "forward whose mask and attention grow with the nodes squared, and accepts at most the "
        "drafter's depth + 1 tokens",
    )
    p.add_argument(
        "--ngram",
        default=None,
        help="N-gram trie directory for the dart tree (diffdraft ngram build), 'default' or 'none' "
        "(default: the shipped trie with --target default, else none)",
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="on a CUDA target (Llama, Qwen2, Qwen3), replay each verification forward from a CUDA graph "
        "instead of launching its kernels one by one",
    )


def load_generator(args: argparse.Namespace) -> SpeculativeGenerator:
    """Load what :func:`add_model_arguments`' options name; without --drafter / --ngram, --target
    default gets the method's shipped drafter and trie, any other target none."""
    drafter, ngram = args.drafter, args.ngram
    method = METHODS[args.method]
    if drafter is None:
        drafter = method.shipped_drafter if args.target == "default" else "none"
    if ngram is None:
        ngram = "default" if args.target == "default" and method.tree is TreeRule.DART else "none"
    return load(
        args.target, drafter, args.method, args.budget, args.dtype, args.device, ngram, args.cuda_graphs
    )
