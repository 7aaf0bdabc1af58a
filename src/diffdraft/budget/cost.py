"""What verifying a DDTree round costs on this machine: t(q, n), probed in seconds and cached.

The best budget depends on the hardware: verifying q tokens in one forward over n cached tokens
costs t(q, n), nearly flat in q up to some size and then growing, and the shape differs between
CPUs, GPUs, dtypes and context lengths. So t is probed once per model shape, dtype and device: a few
forwards of doubling sizes at two context lengths, a few seconds (:func:`probe_verify_cost`), and
cached. The probe is the planner's starting point, not its last word: the rounds a process runs
rescale it (:meth:`~diffdraft.budget.planner.BudgetPlanner.cost`), so a cached curve is never
measured again because the machine is busier or quieter today. t is the whole verification stage of
a round with q tree tokens: ancestor mask, the target forward and greedy acceptance, so host-side
costs that grow with the tree are in the curve. :mod:`diffdraft.budget.planner` weighs it against
expected acceptance.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
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

MAX_BUDGET = 256
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, MAX_BUDGET)
"""Tree sizes the probe times, up to the first that costs :data:`DEAREST_ROUND` plain forwards."""
PROBE_CONTEXTS = (128, 1024)
"""Cached tokens the probe verifies over: attention's share grows with them, at another rate for one
query than for many; the curve is linear between and past them."""
PROBE_REPEATS = 2
"""Timed passes over the probe's points (after one that warms up): the rounds that run correct it."""
PROBE_SECONDS = 10.0
"""After the first timed pass, no further pass starts once a measurement has taken this long, unless
its points still look disturbed (:func:`disturbed`): on a 2-core machine shared with another 2-thread
job a pass took 25 times as long as on a quiet one, and the rounds correct a curve of fewer passes."""
MAX_PASSES = 6
"""Timed passes a measurement whose points still look disturbed may take, at the most."""
DISTURBED = 1.5
"""How many times longer than a point with more work (a bigger tree, a longer context, more
sequences) a point's fastest time may be before the table counts as disturbed."""
DEAREST_ROUND = 32
"""Plain forwards a verification may cost before bigger trees are not probed: a round commits at most
its tree's depth plus one tokens, and no drafter here proposes 31 positions, so a round that costs 32
plain ones cannot pay (a big model on a small CPU reaches it well before 256 tokens, and each size
past it would cost the probe seconds)."""
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
    """The fastest times as measured, before the fit (same layout as :attr:`seconds`)."""

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


def probe_verify_cost(target: TargetModel, progress: bool = False) -> VerifyCostCurve:
    """The auto budget's starting curve: :func:`measure_verify_cost` at :data:`PROBE_SIZES` (those a
    round can pay for) and :data:`PROBE_CONTEXTS`, about 5 s for the default target on 2 quiet cores."""
    return measure_verify_cost(
        target,
        PROBE_SIZES,
        PROBE_CONTEXTS,
        PROBE_REPEATS,
        progress=progress,
        dearest=DEAREST_ROUND,
        seconds_limit=PROBE_SECONDS,
    )


def timed_passes(
    repeats: int, seconds_limit: float | None, fastest: Callable[[], np.ndarray]
) -> Iterator[int]:
    """A measurement's passes: 0, which warms kernels up and is not kept, then timed ones from 1 on.
    After pass 1 they stop once ``repeats`` are done or ``seconds_limit`` seconds (None: no limit)
    have passed since pass 0 began, but not while ``fastest()`` (each point's fastest time so far)
    still looks :func:`disturbed`, up to :data:`MAX_PASSES`. Other work on the machine only ever
    adds time, so a point's fastest time is its best estimate; a probe that kept medians, taken while
    other work ran, put a 16-token verification at 100 times a plain one and the auto
    budget verified 255-node trees at a tenth of plain decoding's speed (docs/decisions.md, "the auto
    budget's curve probed in seconds, corrected by the rounds")."""
    begin = time.perf_counter()
    yield 0
    done = 0
    while done < MAX_PASSES:
        done += 1
        yield done
        enough = done >= repeats or (
            seconds_limit is not None and time.perf_counter() - begin > seconds_limit
        )
        if enough and not disturbed(fastest()):
            return


def disturbed(table: np.ndarray) -> bool:
    """Whether some point of ``table`` (seconds; every axis ordered by rising work) took over
    :data:`DISTURBED` times as long as its neighbour with more work: a forward of more tokens, over
    more cached tokens or of more sequences never costs less, so such a point was timed while
    something else ran."""
    table = np.asarray(table, dtype=float)
    for axis in range(table.ndim):
        if table.shape[axis] > 1:
            less = np.take(table, range(table.shape[axis] - 1), axis=axis)
            more = np.take(table, range(1, table.shape[axis]), axis=axis)
            if np.any(less > DISTURBED * more):
                return True
    return False


def measure_verify_cost(
    target: TargetModel,
    sizes: Sequence[int] = PROBE_SIZES,
    contexts: Sequence[int] = PROBE_CONTEXTS,
    repeats: int = PROBE_REPEATS,
    progress: bool = False,
    dearest: float | None = None,
    seconds_limit: float | None = None,
) -> VerifyCostCurve:
    """Fastest time of a verification stage per size and context over the timed passes
    (:func:`timed_passes`, which also says how many and why the fastest), fitted nondecreasing in both;
    ``dearest``: the sizes past the first whose warm-up round cost that many plain rounds are dropped
    (None: every size is timed); ``seconds_limit``: as :func:`timed_passes` takes it.

    Every timed pass visits every (context, size) point, so drift on a shared machine hits all alike;
    the warm-up pass visits the shortest context only (the shapes are the same at the others).
    A one-token round is plain decoding, whose rounds follow one another with nothing in between,
    so t(1, n) is timed in a run of them (:data:`PLAIN_RUN`): on a CPU whose cache holds much of the
    target's weights, a one-token forward right after a bigger one took much longer than deep in a
    run (the first fifteen of a run came down step by step), a curve that said so made plain
    decoding look dear, and the auto budget drafted at batch 1 where drafting lost
    (docs/decisions.md, "plain rounds timed where they run steady").
    Verifying more tokens over the same cache, or the same tokens over a longer one, does not get
    cheaper, so the times get a least-squares nondecreasing fit (pooling adjacent violators):
    on a shared CPU single times still wander (docs/decisions.md, "cost medians fitted
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
    timings: dict[tuple[int, int], list[float]] = {}

    def fastest() -> np.ndarray:
        return np.asarray([[min(timings[n, q]) for q in sizes] for n in contexts])

    with progress_bar(
        total=(repeats * len(contexts) + 1) * len(sizes),
        desc="verify cost t(q, n)",
        disable=not progress,
        leave=False,
    ) as steps:
        for repeat in timed_passes(repeats, seconds_limit, fastest):
            for n in contexts if repeat else contexts[:1]:
                for q in sizes:
                    seconds = (_time_plain if q == 1 else _time_one)(target, caches[n], ids[n : n + q])
                    if repeat:
                        timings.setdefault((n, q), []).append(seconds)
                    elif q == 1:
                        plain = seconds
                    steps.update()
                    if dearest is not None and not repeat and q > 1 and seconds > dearest * plain:
                        steps.total -= (repeats * len(contexts) + 1) * (len(sizes) - sizes.index(q) - 1)
                        sizes = sizes[: sizes.index(q) + 1]
                        break
    measured = fastest().tolist()
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
    """The cached curve for this model shape and device, probed (:func:`probe_verify_cost`) and cached
    when absent, when ``refresh`` asks or when it fails its digest check
    (:mod:`diffdraft.util.cache_digest`). An intact curve is used as it is: the rounds correct it, and
    spot checks that measured a curve anew whenever the machine was busier than when it was measured
    had a first request wait minutes, several runs in a row (docs/decisions.md, "the auto budget's
    curve probed in seconds, corrected by the rounds")."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "verify_cost"
    file = folder / f"{curve_key(target)}.json"
    if not refresh and intact(file, "the cached verification cost curve", "probing it again"):
        return VerifyCostCurve(**json.loads(file.read_text()))
    if progress:
        print(
            f"diffdraft: timing a few verification forwards of this target for budget 'auto' (seconds; "
            f"kept in {file} and corrected by the rounds each run times)",
            file=sys.stderr,
        )
    curve = probe_verify_cost(target, progress=progress)
    with sealed_file(file) as written:
        written.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
    return curve
