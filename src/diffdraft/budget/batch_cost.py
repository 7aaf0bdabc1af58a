"""What one packed verification forward of several sequences costs on this machine.

Batched rounds verify every sequence's tree in one forward (:meth:`TargetModel.verify_batch`):
projections and MLPs run over all sequences' tokens at once, attention over each sequence's own
cache. Its time is no sum of single-sequence costs (the weights are read once), so it is measured
over the number of sequences, the tokens per sequence and the context, once per model shape, dtype
and device (about 10 s for the default target on 2 cores), and cached beside the single-sequence curve
(:mod:`diffdraft.budget.cost`), which it extends; as that curve, it is a starting point the rounds
correct, never measured again because the machine is busier today.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import torch

from diffdraft.budget.cost import (
    PROBE_REPEATS,
    PROBE_SECONDS,
    curve_key,
    monotone_fit,
    synthetic_tree,
    timed_in_a_run,
    timed_passes,
)
from diffdraft.decoding.verify import accept
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel, VerifyInput
from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import intact, sealed_file
from diffdraft.util.progress import progress_bar

BATCHES = (2, 4, 8)
"""Sequences per forward; one alone is the single-sequence curve's."""
SIZES = (1, 2, 4, 8, 16)
"""Tokens per sequence: batched rounds pay for small trees only (larger totals extrapolate). Size 2
is measured because the first tokens a round adds cost the most: a line from size 1 to 4 promised
the next token well under what it took, and free copies taken on that promise lost
(docs/decisions.md, "the batch cost curve measures size 2")."""
CONTEXTS = (128, 512)
MEASURED = "plain-in-a-run"
"""How the cached curves were measured: a change names new files, so no curve measured the old way
is read."""


@dataclass
class BatchCostCurve:
    """Measured seconds of verifying ``batch`` sequences' trees (masks, one packed forward, each
    sequence's acceptance) with ``size`` tokens each over ``context`` cached tokens each."""

    batches: list[int]
    sizes: list[int]
    contexts: list[int]
    seconds: list[list[list[float]]]
    """``seconds[b][i][j]``: batches[b] sequences of sizes[j] tokens over contexts[i] cached tokens,
    fitted nondecreasing along every axis (more work never costs less)."""
    key: str = ""
    measured_at: str = ""
    measured: list[list[list[float]]] = field(default_factory=list)
    """The fastest times as measured, before the fit."""

    def __call__(
        self, tokens: float | np.ndarray, batch: float | np.ndarray, context: float | np.ndarray
    ) -> float | np.ndarray:
        """Seconds of a forward of ``tokens`` in all shared by ``batch`` sequences over ``context``
        cached tokens each (their mean when they differ), linear between measured points and past
        the largest; sequences share the tokens evenly. Any of them may be an array (they broadcast:
        one forward each), so a finished sequence's forwards are looked up together: one at a time,
        the lookups were most of what learning from it cost (docs/decisions.md, "plans bounded and
        stood under load")."""
        tokens, batch, context = np.broadcast_arrays(
            np.asarray(tokens, dtype=float), np.asarray(batch, dtype=float), np.asarray(context, dtype=float)
        )
        _, contexts, sizes = self._table.shape
        flat = self._table.ravel()
        low_size, high_size, size_share = _bracket(tokens / batch, self.sizes)
        low_context, high_context, context_share = _bracket(context, self.contexts)
        low_batch, high_batch, batch_share = _bracket(batch, self.batches)

        def along_sizes(row: np.ndarray, column: np.ndarray) -> np.ndarray:
            start = (row * contexts + column) * sizes
            low = flat[start + low_size]
            return low + size_share * (flat[start + high_size] - low)

        def at_batch(row: np.ndarray) -> np.ndarray:
            low = along_sizes(row, low_context)
            return low + context_share * (along_sizes(row, high_context) - low)

        low = at_batch(low_batch)
        seconds = low + batch_share * (at_batch(high_batch) - low)
        return float(seconds) if seconds.ndim == 0 else seconds

    @cached_property
    def _table(self) -> np.ndarray:
        """:attr:`seconds` as one array (a planner asks for costs several times a round)."""
        return np.asarray(self.seconds, dtype=float)

    def to_dict(self) -> dict:
        return asdict(self)


def _bracket(x: np.ndarray, points: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each ``x``: the indices of the two measured ``points`` it lies between (the last two past
    the end) and its share of the way from the first to the second: 0 before the first point (flat
    there), over 1 past the last (extrapolated linearly)."""
    if len(points) == 1:
        first = np.zeros(x.shape, dtype=int)
        return first, first, np.zeros(x.shape)
    at = np.asarray(points, dtype=float)
    high = np.clip(np.searchsorted(at, x), 1, len(at) - 1)
    low = high - 1
    return low, high, np.maximum((x - at[low]) / (at[high] - at[low]), 0.0)


def measure_batch_cost(
    target: TargetModel,
    batches: Sequence[int] = BATCHES,
    sizes: Sequence[int] = SIZES,
    contexts: Sequence[int] = CONTEXTS,
    repeats: int = PROBE_REPEATS,
    progress: bool = False,
    seconds_limit: float | None = None,
) -> BatchCostCurve:
    """Fastest time of a batched verification stage per point, fitted nondecreasing in every axis
    (see :func:`diffdraft.budget.measure_verify_cost`: same passes, the same limit on them, same fit,
    one token a sequence timed in a run of such rounds). Timed between other sizes, one token a
    sequence took far longer than in plain decoding's rounds, and a plan that read it so before it had
    timed plain rounds of its own drafted where plain decoding was faster (docs/decisions.md, "plain
    rounds timed where they run steady")."""
    sizes = sorted({q for q in sizes if q <= target.max_context // 2})
    contexts = sorted({min(n, target.max_context - sizes[-1]) for n in contexts})
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (contexts[-1] + sizes[-1],), generator=generator).to(
        target.device
    )
    caches = {(n, i): target.new_cache() for n in contexts for i in range(max(batches))}
    for (n, _), cache in caches.items():
        target.prefill(cache, ids[:n], [])
    points = [(b, n, q) for b in batches for n in contexts for q in sizes]
    timings: dict[tuple[int, int, int], list[float]] = {point: [] for point in points}

    def fastest() -> np.ndarray:
        return np.asarray([[[min(timings[b, n, q]) for q in sizes] for n in contexts] for b in batches])

    warm_up = [(b, n, q) for b, n, q in points if n == contexts[0]]  # the same shapes as the others
    total = len(warm_up) + repeats * len(points)
    with progress_bar(total=total, desc="batch verify cost", disable=not progress, leave=False) as steps:
        for repeat in timed_passes(repeats, seconds_limit, fastest):
            for b, n, q in points if repeat else warm_up:
                batch, tokens = [caches[n, i] for i in range(b)], ids[n : n + q]
                if q == 1:  # plain decoding's rounds: timed in a run, as the single-sequence curve's
                    seconds = timed_in_a_run(partial(_time_batch, target, batch, tokens))
                else:
                    seconds = _time_batch(target, batch, tokens)
                if repeat:
                    timings[b, n, q].append(seconds)
                steps.update()
    measured = fastest().tolist()
    return BatchCostCurve(
        batches=list(batches),
        sizes=list(sizes),
        contexts=list(contexts),
        seconds=_monotone_in_batch([monotone_fit(table) for table in measured]),
        key=curve_key(target),
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        measured=measured,
    )


def _monotone_in_batch(tables: list[list[list[float]]]) -> list[list[list[float]]]:
    """``tables`` [batch][context][size], each monotone in context and size, fitted nondecreasing
    along batch too (the fit is order-preserving, so the other axes stay monotone)."""
    stacked = np.asarray(tables, dtype=float)
    flat = stacked.reshape(len(tables), -1)
    fitted = np.asarray([monotone_fit([column])[0] for column in flat.T]).T
    return fitted.reshape(stacked.shape).tolist()


def _time_batch(target: TargetModel, caches: list, tokens: torch.Tensor) -> float:
    """Seconds of one batched verification stage of ``tokens`` as a DDTree-shaped tree for every
    cache; the caches are left as they were."""
    tree = synthetic_tree(tokens)
    begin = time.perf_counter()
    inputs = []
    for cache in caches:
        context = cache.get_seq_length()
        mask = target.attention_mask(cache, tree.ancestor_mask()) if tree.num_nodes else None
        inputs.append(VerifyInput(cache, tree.tokens, tree.position_ids(context), mask))
    for out in target.verify_batch(inputs, []):
        accept(tree, out.logits, SamplingParams(), None)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    for cache in caches:
        cache.crop(-tokens.shape[0])
    return seconds


def load_or_measure_batch_cost(
    target: TargetModel, cache_dir: str | Path | None = None, progress: bool = False, refresh: bool = False
) -> BatchCostCurve:
    """The cached curve for this model shape and device, measured (and cached) when absent, when
    ``refresh`` asks, when it fails its digest check (:mod:`diffdraft.util.cache_digest`) or when it was
    measured on another grid of points (:func:`~diffdraft.budget.cost.load_or_measure` says why no
    spot check)."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "batch_verify_cost"
    file = folder / f"{curve_key(target)}-{MEASURED}.json"
    if not refresh and intact(file, "the cached batch verification cost curve", "measuring it again"):
        cached = BatchCostCurve(**json.loads(file.read_text()))
        grid = (cached.batches, cached.sizes, cached.contexts)
        if grid == (list(BATCHES), list(SIZES), list(CONTEXTS)):
            return cached
    if progress:
        print(
            f"diffdraft: timing forwards shared by {BATCHES[0]}-{BATCHES[-1]} sequences for budget 'auto' "
            f"(seconds; kept in {file} and corrected by the rounds each run times)",
            file=sys.stderr,
        )
    curve = measure_batch_cost(
        target, BATCHES, SIZES, CONTEXTS, progress=progress, seconds_limit=PROBE_SECONDS
    )
    with sealed_file(file) as written:
        written.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
    return curve
