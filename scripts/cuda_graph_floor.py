"""What CUDA graphs would buy a verification forward on this GPU (issue 31): a random-weight target of
a real shape, q new tokens over a prefilled cache, timed eager and as a CUDA-graph replay.

    python scripts/cuda_graph_floor.py --shape qwen3-8b --tokens 1 16 64

A replay recomputes the same step over the same cache (the captured cache append writes to fixed
memory), so it times a forward with no host launch cost, not a decoding loop: the floor a
graph-captured verify would reach. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from diffdraft.bench.synthetic import SHAPES, build_target
from diffdraft.kernels.graphed_verify import captured


def median_ms(step: Callable[[], object], repeats: int = 30, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def eager_and_replayed(model: torch.nn.Module, context: int, tokens: int) -> tuple[float, float]:
    """Median ms of one forward of ``tokens`` over ``context`` cached ones, eager and replayed."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), device="cuda")
    new = torch.randint(0, vocab, (1, tokens), device="cuda")
    positions = torch.arange(context, context + tokens, device="cuda")[None]
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    prefilled = [(layer.keys, layer.values) for layer in cache.layers]

    def step() -> None:
        for layer, (keys, values) in zip(cache.layers, prefilled, strict=True):
            layer.keys, layer.values = keys, values  # every step appends to the same prefill
        model(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True)

    return median_ms(step), median_ms(captured(step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, help="cached tokens (default: the shape's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_graph_floor.py needs a CUDA device")
    shape = SHAPES[args.shape]
    model = build_target(shape, torch.device("cuda"), torch.bfloat16, seed=0)
    print(f"{args.shape} on {torch.cuda.get_device_name()}, context {args.context or shape.context}")
    for tokens in args.tokens:
        eager, replay = eager_and_replayed(model, args.context or shape.context, tokens)
        ratio = eager / replay
        print(f"q={tokens:3d}: eager {eager:7.2f} ms, cuda graph replay {replay:7.2f} ms ({ratio:.1f}x)")


if __name__ == "__main__":
    main()
