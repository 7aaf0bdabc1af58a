"""What verifying a DDTree round costs on this machine: t(q, n), measured once and cached.

The best budget depends on the hardware: verifying q tokens in one forward over n cached tokens
costs t(q, n), nearly flat in q up to some size and then growing, and the shape differs between
CPUs, GPUs, dtypes and context lengths. So t is measured once per model shape, dtype and device,
at a few context lengths, and cached. t is the whole verification stage of a round with q tree
tokens: ancestor mask, the target forward and greedy acceptance, so host-side costs that grow with
the tree are in the curve. :mod:`diffdraft.budget.planner` weighs it against expected acceptance.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from diffdraft.decoding.verify import accept
from diffdraft.kernels.fused_projections import ProjectionSlice
from diffdraft.kernels.grouped_attention import ROW_DTYPES
from diffdraft.kernels.packed_linear import has_packed_layers
from diffdraft.kernels.quantized.block_linear import block_kernels
from diffdraft.kernels.quantized.kernel_build import library_key
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree
from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import intact, sealed_file
from diffdraft.util.progress import progress_bar

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_CONTEXTS = (128, 256, 512, 1024)
MAX_BUDGET = 256
PLAIN_RUN = 32
"""One-token rounds timed back to back at each point of t(1, n); the second half counts."""
_GREEDY = SamplingParams()


@dataclass
class VerifyCostCurve:
    """Measured seconds t(q, n) of verifying a q-token tree (mask, forward, acceptance) over n cached
    tokens. The context matters as much as q on a CPU: attention over the cache grows with n, and
    at different rates for one query and for many."""

    sizes: list[int]
    contexts: list[int]
    seconds: list[list[float]]
    """``seconds[i][j]`` is t(sizes[j]) over contexts[i] cached tokens: the monotone fit of
    :attr:`measured` the planner uses."""
    key: str = ""
    measured_at: str = ""
    measured: list[list[float]] = field(default_factory=list)
    """The medians as measured, before the fit (same layout as :attr:`seconds`)."""

    def __call__(self, q: float | np.ndarray, context: float) -> float | np.ndarray:
        """t(q, n), linear between measured points, extrapolated linearly past the largest size and
        context (and flat below the smallest context); ``q`` may be an array of sizes."""
        return interpolate(q, self.sizes, blend_rows(context, self.contexts, self.seconds))

    def to_dict(self) -> dict:
        return asdict(self)


def interpolate(x: float | np.ndarray, xs: Sequence[float], ys: Sequence[float]) -> float | np.ndarray:
    """Linear between the points ``(xs, ys)``, extrapolated linearly past the last one and flat
    before the first; a float for a float ``x``, an array for an array."""
    inside = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        inside = np.where(np.asarray(x) > xs[-1], ys[-1] + slope * (np.asarray(x) - xs[-1]), inside)
    return float(inside) if np.ndim(x) == 0 else inside


def blend_rows(x: float, xs: Sequence[float], rows: Sequence[Sequence[float]]) -> np.ndarray:
    """The row at ``x`` among ``rows`` measured at ``xs``, each entry interpolated as :func:`interpolate`
    does (a table at one context, say, from tables at several)."""
    table = np.asarray(rows, dtype=float)
    if len(xs) == 1 or x <= xs[0]:
        return table[0]
    upper = min(int(np.searchsorted(xs, x)), len(xs) - 1)  # x past the last point: the last pair
    lower = upper - 1
    share = (x - xs[lower]) / (xs[upper] - xs[lower])
    return table[lower] + share * (table[upper] - table[lower])


def measure_verify_cost(
    target: TargetModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 7,
    progress: bool = False,
) -> VerifyCostCurve:
    """Median time of a verification stage per size and context, fitted nondecreasing in both.

    Every pass visits every (context, size) point, so drift on a shared machine hits all alike.
    A one-token round is plain decoding, whose rounds follow one another with nothing in between,
    so t(1, n) is timed in a run of them (:data:`PLAIN_RUN`): on a CPU whose cache holds much of the
    target's weights, a one-token forward right after a bigger one took much longer than deep in a
    run (the first fifteen of a run came down step by step), a curve that said so made plain
    decoding look dear, and the auto budget drafted at batch 1 where drafting lost
    (docs/decisions.md, "plain rounds timed where they run steady").
    Verifying more tokens over the same cache, or the same tokens over a longer one, does not get
    cheaper, so the medians get a least-squares nondecreasing fit (pooling adjacent violators):
    on a shared CPU single medians still wander (docs/decisions.md, "cost medians fitted
    nondecreasing, spot-checked twice"), and a point measured low (t(4) below
    t(2)) would pull the planner's choice towards it. Pooling averages neighbours instead of
    carrying one high point into every larger size, as a running maximum would.
    """
    sizes = sorted({q for q in sizes if q <= target.max_context // 2} | {1})  # short-context models
    contexts = sorted({min(n, target.max_context - sizes[-1]) for n in contexts})
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (contexts[-1] + sizes[-1],), generator=generator)
    caches = {n: target.new_cache() for n in contexts}
    for n, cache in caches.items():
        target.prefill(cache, ids[:n].to(target.device), [])
    timings: dict[tuple[int, int], list[float]] = {(n, q): [] for n in contexts for q in sizes}
    points = (repeats + 1) * len(timings)
    with progress_bar(total=points, desc="verify cost t(q, n)", disable=not progress, leave=False) as steps:
        for repeat in range(repeats + 1):  # the first pass warms kernels up and is not kept
            for n, q in timings:
                seconds = (_time_plain if q == 1 else _time_one)(target, caches[n], ids[n : n + q])
                if repeat:
                    timings[n, q].append(seconds)
                steps.update()
    measured = [[float(np.median(timings[n, q])) for q in sizes] for n in contexts]
    return VerifyCostCurve(
        sizes=list(sizes),
        contexts=list(contexts),
        seconds=monotone_fit(measured),
        key=curve_key(target),
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        measured=measured,
    )


def monotone_fit(table: Sequence[Sequence[float]]) -> list[list[float]]:
    """``table`` [context][size] fitted nondecreasing along sizes, then along contexts (pooling
    keeps a fitted row nondecreasing, so the result is monotone in both)."""
    rows = [_nondecreasing(row) for row in table]
    columns = [_nondecreasing(column) for column in zip(*rows, strict=True)]
    return [list(row) for row in zip(*columns, strict=True)]


def _nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares nondecreasing fit of ``values`` (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            previous = blocks[-1]
            previous[0] = (previous[0] * previous[1] + mean * count) / (previous[1] + count)
            previous[1] += count
    return [mean for mean, count in blocks for _ in range(int(count))]


def _time_one(target: TargetModel, cache: DynamicCache, tokens: torch.Tensor) -> float:
    """Seconds of one verification stage of ``tokens`` as a DDTree-shaped tree; the cache is left
    as it was."""
    context = cache.get_seq_length()
    tree = synthetic_tree(tokens.to(target.device))
    begin = time.perf_counter()
    mask = target.attention_mask(cache, tree.ancestor_mask()) if tree.num_nodes else None
    out = target.verify(cache, tree.tokens, tree.position_ids(context), mask, [])
    accept(tree, out.logits, _GREEDY, None)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    cache.crop(-tokens.shape[0])
    return seconds


def _time_plain(target: TargetModel, cache: DynamicCache, token: torch.Tensor) -> float:
    """:func:`timed_in_a_run` one-token rounds; the cache is left as it was."""
    return timed_in_a_run(lambda: _time_one(target, cache, token))


def timed_in_a_run(time_round: Callable[[], float]) -> float:
    """Median seconds of the second half of :data:`PLAIN_RUN` rounds run back to back, each timed by
    ``time_round`` (the first half brings the weights back into the cache)."""
    return float(np.median([time_round() for _ in range(PLAIN_RUN)][PLAIN_RUN // 2 :]))


def synthetic_tree(tokens: torch.Tensor) -> DraftTree:
    """A tree of the given tokens shaped like a DDTree: node i hangs under node i - 16, so depth stays
    within a drafter block however many nodes there are."""
    nodes = torch.arange(tokens.shape[0], device=tokens.device)
    parents = (nodes - 16).clamp_min(0)
    parents[0] = -1
    depths = (nodes + 15) // 16
    return DraftTree(tokens, parents, depths)


SPOT_CHECKS = 2
"""Probes a cached curve gets before it is measured anew (:func:`passes_a_spot_check`)."""


def passes_a_spot_check(probe: Callable[[], bool]) -> bool:
    """Whether one of :data:`SPOT_CHECKS` runs of ``probe`` finds a cached curve still right. One
    probe of plain decoding wanders, now and then past the tolerance, and a curve thrown away on one
    probe was measured anew, for half a minute, at such starts (docs/decisions.md, "cost medians
    fitted nondecreasing, spot-checked twice")."""
    return any(probe() for _ in range(SPOT_CHECKS))


def still_valid(curve: VerifyCostCurve, target: TargetModel, tolerance: float = 0.25) -> bool:
    """Spot-check a cached curve at two sizes: a curve measured while other jobs loaded the machine
    (or before a hardware change) would mislead every budget choice."""

    def probe() -> bool:
        measured = measure_verify_cost(
            target,
            sizes=sorted({curve.sizes[0], curve.sizes[len(curve.sizes) // 2]}),
            contexts=[curve.contexts[len(curve.contexts) // 2]],
            repeats=3,
        )
        context = measured.contexts[0]
        return all(
            abs(t - curve(q, context)) <= tolerance * curve(q, context)
            for q, t in zip(measured.sizes, measured.seconds[0], strict=True)
        )

    return passes_a_spot_check(probe)


def curve_key(target: TargetModel) -> str:
    """Identifies what t depends on: model shape (not weights or path), dtype, kernels, device,
    threads, CPU."""
    config = {k: v for k, v in target.model.config.to_dict().items() if k not in ("_name_or_path", "dtype")}
    facts = {
        "config": config,
        "dtype": str(target.dtype),
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "packed": has_packed_layers(target.model),
        "block_kernels": block_kernels(target.model),
        "kernel_library": library_key() if block_kernels(target.model) else None,
        "attention": target.model.config._attn_implementation,
        "grouped_rows": [str(dtype) for dtype in ROW_DTYPES],
        "stacked": any(isinstance(module, ProjectionSlice) for module in target.model.modules()),
        "cache": type(target.new_cache().layers[0]).__name__,
        "lean_forward": target.lean is not None,
        "stage": "mask+forward+accept per context, fitted, one token deep in a run",  # a change: new curves
    }
    digest = hashlib.sha1(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:12]
    dtype = str(target.dtype).removeprefix("torch.")
    return f"{config.get('model_type', 'model')}-{dtype}-{target.device.type}-{digest}"


def load_or_measure(
    target: TargetModel,
    refresh: bool = False,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> VerifyCostCurve:
    """The cached curve for this model shape and device, measuring (and caching) it when absent, when
    it fails its digest check (:mod:`diffdraft.util.cache_digest`) or when a spot check no longer
    matches it."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "verify_cost"
    file = folder / f"{curve_key(target)}.json"
    if not refresh and intact(file, "the cached verification cost curve", "measuring it again"):
        cached = VerifyCostCurve(**json.loads(file.read_text()))
        if still_valid(cached, target):
            return cached
    if progress:
        print(
            f"diffdraft: measuring this machine's verification cost for budget 'auto' "
            f"(once; cached in {file})",
            file=sys.stderr,
        )
    curve = measure_verify_cost(target, DEFAULT_SIZES, DEFAULT_CONTEXTS, progress=progress)
    with sealed_file(file) as written:
        written.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
    return curve
