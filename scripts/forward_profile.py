"""Where a target forward's time goes on this machine: ours by op kind, llama.cpp's per token.

Times a 1-token decode and a q-token verification (a chain under a tree mask) over the same cached
context, for our target (diffdraft's CPU kernels) and, when ``llama-cpp-python`` is installed, for
llama.cpp on the target's GGUF and on a bf16 copy of it. Our forwards are then timed again with
every linear layer (the stacked projections, the MLP, the LM head) timed on its own, which splits a
forward into the weights' matmuls and everything else (attention, norms, rotary, cache, Python).

    python scripts/forward_profile.py --target default --dtype bfloat16 --context 256 --tokens 9 \
        --out benchmarks/forward-profile

``--block-activations bf16`` times the block layers' exact-bf16 kernel instead of the default int8 one
(:mod:`diffdraft.kernels.quantized.block_linear`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from diffdraft.bench.gguf_precision import dense_gguf
from diffdraft.bench.llamacpp import INSTALL
from diffdraft.kernels.packed_linear import PackedLinear
from diffdraft.kernels.quantized.block_linear import ACTIVATIONS, BlockQuantizedLinear, has_block_layers
from diffdraft.target.default_model import default_gguf_path
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees.tree import DraftTree


@contextmanager
def timed_linears() -> Iterator[list[float]]:
    """Time every packed or block-quantized linear call inside the block; the yielded list's one entry
    sums their seconds. (The torch profiler would split ops too, but here it slows oneDNN's multi-row
    matmuls tenfold.)"""
    total = [0.0]
    kinds = (PackedLinear, BlockQuantizedLinear)
    plain = {kind: kind.forward for kind in kinds}

    def timed(kind: type) -> Callable:
        def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            out = plain[kind](self, x)
            total[0] += time.perf_counter() - begin
            return out

        return forward

    for kind in kinds:
        kind.forward = timed(kind)
    try:
        yield total
    finally:
        for kind in kinds:
            kind.forward = plain[kind]


def ours(target: TargetModel, context: torch.Tensor, tokens: torch.Tensor, repeats: int) -> dict:
    """Median ms of one forward of ``tokens`` over ``context``, and the profiled split by op kind."""
    cache = target.new_cache()
    target.prefill(cache, context, [])
    start = context.shape[0]
    n = tokens.shape[0]
    tree = DraftTree(tokens, torch.arange(-1, n - 1), torch.arange(n))
    mask = target.attention_mask(cache, tree.ancestor_mask()) if n > 1 else None

    def forward() -> None:
        target.verify(cache, tree.tokens, tree.position_ids(start), mask, [])
        cache.crop(-n)

    for _ in range(3):
        forward()
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        forward()
        seconds.append(time.perf_counter() - begin)
    with timed_linears() as linear:
        begin = time.perf_counter()
        for _ in range(repeats):
            forward()
        wall = (time.perf_counter() - begin) / repeats
    linear_seconds = linear[0] / repeats
    split = {"linear layers": linear_seconds, "everything else": wall - linear_seconds}
    return {
        "ms": 1e3 * statistics.median(seconds),
        "timed_ms": 1e3 * wall,
        "split_ms": {k: 1e3 * v for k, v in split.items()},
    }


def llama_cpp_ms(gguf: Path, context: list[int], tokens: list[int], repeats: int, threads: int) -> float:
    """Median ms of one llama.cpp decode of ``tokens`` over ``context`` (the cache rolled back after)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=0, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    llm.eval(context)
    seconds = []
    for repeat in range(repeats + 3):
        begin = time.perf_counter()
        llm.eval(tokens)
        if repeat >= 3:
            seconds.append(time.perf_counter() - begin)
        llm._ctx.kv_cache_seq_rm(-1, len(context), -1)
        llm.n_tokens = len(context)
    return 1e3 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the forward")
    parser.add_argument("--tokens", type=int, default=9, help="tokens of the verification forward")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("forward-profile"))
    parser.add_argument(
        "--dense", action="store_true", help="dense weights even where the GGUF's blocks could be kept"
    )
    parser.add_argument(
        "--block-activations", choices=ACTIVATIONS, default=ACTIVATIONS[0], help="the block layers' kernel"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_target(
        args.target,
        dtype=args.dtype,
        optimize=True,
        gguf_blocks=not args.dense,
        block_activations=args.block_activations,
    )
    target = TargetModel(loaded.model)
    ids = torch.randint(
        0, target.vocab_size, (args.context + args.tokens,), generator=torch.Generator().manual_seed(0)
    )
    context, tokens = ids[: args.context], ids[args.context :]
    rows = {}
    blocks = has_block_layers(loaded.model) and not args.dense
    weights = f"GGUF blocks ({args.block_activations} activations)" if blocks else "dense"
    for q in (1, args.tokens):
        name = f"diffdraft {args.dtype} {weights}, {q} token(s)"
        rows[name] = ours(target, context, tokens[:q], args.repeats)
        print(f"{name}: {rows[name]}", flush=True)
    engines = {}
    if str(args.target) == "default" or str(args.target).endswith(".gguf"):
        if importlib.util.find_spec("llama_cpp") is None:
            print(f"llama.cpp rows skipped: {INSTALL}")
        else:
            gguf = default_gguf_path() if str(args.target) == "default" else Path(args.target)
            files = {"as shipped": gguf, "bf16": dense_gguf(gguf, "bf16")}
            for name, path in files.items():
                for q in (1, args.tokens):
                    engines[f"llama.cpp {name}, {q} token(s)"] = llama_cpp_ms(
                        path, context.tolist(), tokens[:q].tolist(), args.repeats, torch.get_num_threads()
                    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": vars(args) | {"out": str(args.out)},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ours": rows,
        "llama_cpp_ms": engines,
    }
    (args.out / "forward_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    kinds = ["linear layers", "everything else"]
    lines = [
        f"| forward ({args.context} cached tokens) | ms | " + " | ".join(kinds) + " |",
        "|---|---|" + "---|" * len(kinds),
    ]
    for name, row in rows.items():
        shares = " | ".join(f"{row['split_ms'][k]:.1f}" for k in kinds)
        lines.append(f"| {name} | {row['ms']:.1f} | {shares} |")
    for name, ms in engines.items():
        lines.append(f"| {name} | {ms:.1f} |" + " |" * len(kinds))
    (args.out / "forward_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
