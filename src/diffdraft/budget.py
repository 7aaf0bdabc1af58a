"""What a DDTree round costs on this machine, and the budget that buys the most tokens per second.

The best budget depends on the hardware: verifying q tokens in one forward over n cached tokens
costs t(q, n), nearly flat in q up to some size and then growing, and the shape differs between
CPUs, GPUs, dtypes and context lengths. So t is measured once per model shape, dtype and device,
at a few context lengths, and cached. The drafter's side is the DDTree surrogate: the optimal
B-node tree's expected acceptance length is 1 + the sum of its B prefix probabilities, which the
best-first order gives for every B at once. Drafters are rarely calibrated, so what the target
accepted in recent rounds replaces the surrogate wherever it can (:class:`BudgetPlanner`), and
the chosen budget for a round over n cached tokens maximizes

    expected tokens per second (B) = tau(B) / (t(B + 1, n) + per-round cost outside verification).

t is the whole verification stage of a round with q tree tokens: ancestor mask, the target
forward and greedy acceptance, so host-side costs that grow with the tree are in the curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from diffdraft.atomic_write import write_text_atomically
from diffdraft.default_model import cache_root
from diffdraft.kernels.fused_projections import ProjectionSlice
from diffdraft.kernels.grouped_attention import ROW_DTYPES
from diffdraft.kernels.packed_linear import has_packed_layers
from diffdraft.kernels.quantized.block_linear import block_kernels
from diffdraft.progress import progress_bar
from diffdraft.sampling import SamplingParams
from diffdraft.stats import GenerationStats
from diffdraft.target import TargetModel
from diffdraft.trees import DraftTree
from diffdraft.verify import accept

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_CONTEXTS = (128, 256, 512, 1024)
MAX_BUDGET = 256
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
    Verifying more tokens over the same cache, or the same tokens over a longer one, does not get
    cheaper, so the medians get a least-squares nondecreasing fit (pooling adjacent violators):
    on a shared CPU single medians still wander by ~10%, and a point measured low (t(4) below
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
                seconds = _time_one(target, caches[n], ids[n : n + q])
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


def synthetic_tree(tokens: torch.Tensor) -> DraftTree:
    """A tree of the given tokens shaped like a DDTree: node i hangs under node i - 16, so depth stays
    within a drafter block however many nodes there are."""
    nodes = torch.arange(tokens.shape[0], device=tokens.device)
    parents = (nodes - 16).clamp_min(0)
    parents[0] = -1
    depths = (nodes + 15) // 16
    return DraftTree(tokens, parents, depths)


def still_valid(curve: VerifyCostCurve, target: TargetModel, tolerance: float = 0.25) -> bool:
    """Spot-check a cached curve at two sizes: a curve measured while other jobs loaded the machine
    (or before a hardware change) would mislead every budget choice."""
    probe = measure_verify_cost(
        target,
        sizes=sorted({curve.sizes[0], curve.sizes[len(curve.sizes) // 2]}),
        contexts=[curve.contexts[len(curve.contexts) // 2]],
        repeats=3,
    )
    context = probe.contexts[0]
    return all(
        abs(t - curve(q, context)) <= tolerance * curve(q, context)
        for q, t in zip(probe.sizes, probe.seconds[0], strict=True)
    )


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
        "attention": target.model.config._attn_implementation,
        "grouped_rows": [str(dtype) for dtype in ROW_DTYPES],
        "stacked": any(isinstance(module, ProjectionSlice) for module in target.model.modules()),
        "cache": type(target.new_cache().layers[0]).__name__,
        "lean_forward": target.lean is not None,
        "stage": "mask+forward+accept per context, fitted",  # a change must not reuse old curves
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
    """The cached curve for this model shape and device, measuring (and caching) it when absent or
    when a spot check no longer matches it."""
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "verify_cost"
    file = folder / f"{curve_key(target)}.json"
    if file.is_file() and not refresh:
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
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(file, json.dumps(curve.to_dict(), indent=1) + "\n")
    return curve


def surrogate_acceptance(tree: DraftTree, log_probs: torch.Tensor) -> list[float]:
    """Expected acceptance length (bonus included) of the first B nodes of a best-first DDTree, per B.

    Entry B is ``1 + sum of the first B prefix probabilities`` under the drafter's factorized
    surrogate; entry 0 is 1 (the bonus token alone). Best-first order makes every prefix of the
    node list the optimal tree of that size.
    """
    depths = tree.depths.cpu()
    node_log_probs = log_probs.float().cpu()[(depths[1:] - 1).clamp_min(0), tree.tokens[1:].cpu()]
    prefix = torch.zeros(depths.shape[0])
    parents = tree.parents.cpu()
    for level in range(1, int(depths.max()) + 1):
        nodes = (depths == level).nonzero().squeeze(-1)
        prefix[nodes] = prefix[parents[nodes]] + node_log_probs[nodes - 1]
    return [1.0, *(1.0 + prefix[1:].exp().cumsum(0)).tolist()]


@dataclass
class BudgetChoice:
    budget: int
    tokens_per_second: float
    """Expected tokens per second at the chosen budget."""
    expected: dict[int, float] = field(default_factory=dict)
    """Expected tokens per second for every candidate budget."""


def choose_budget(
    cost: Callable[[float, float], float],
    expected_tau: Sequence[float],
    context: int,
    fixed_seconds: float = 0.0,
    budgets: Sequence[int] | None = None,
) -> BudgetChoice:
    """The budget B maximizing ``expected_tau[B] / (t(B + 1, context) + fixed_seconds)``.

    ``cost`` is t(q, n) (a :class:`VerifyCostCurve` or the planner's calibrated one);
    ``expected_tau[B]`` is the expected acceptance length with B drafted nodes; candidates default
    to every B it covers. ``context`` is the number of cached tokens the round verifies over.
    ``fixed_seconds`` is the per-round cost outside verification (drafter forward, tree build,
    commit, loop overhead), which barely depends on the budget. Costs are taken nondecreasing in B:
    verifying more tokens never gets cheaper, whatever noise a calibration picked up.
    """
    candidates = sorted(b for b in (budgets or range(1, len(expected_tau))) if b < len(expected_tau))
    if not candidates:
        raise ValueError("no candidate budget has an expected acceptance length")
    seconds = np.maximum.accumulate([cost(b + 1, context) for b in candidates])
    expected = {b: expected_tau[b] / (t + fixed_seconds) for b, t in zip(candidates, seconds, strict=True)}
    best = max(expected, key=lambda b: (expected[b], -b))
    return BudgetChoice(best, expected[best], expected)


@dataclass(frozen=True)
class ObservedRound:
    """What one verified round teaches the planner."""

    budget: int
    """Draft nodes the round verified (its tree may have been cut short of the budget asked)."""
    accepted: Sequence[int]
    """Best-first indices of the draft nodes the target accepted."""
    context: int = 0
    """Cached tokens the round verified over."""
    seconds: float = 0.0
    """Its verification forward; 0 when not timed."""
    forward: tuple[int, int, int] | None = None
    """The forward's shape when several sequences shared it: (sequences, tokens, mean cached tokens);
    None when the round's tree was verified alone."""


def rounds_of(stats: GenerationStats) -> list[ObservedRound]:
    """A sequence's verified rounds as the planner learns from them: every list is one entry per
    round, recorded by the round itself, so nothing from another sequence can be mixed in."""
    return [
        ObservedRound(size, accepted, context, seconds, None if forward[0] == 1 else tuple(forward))
        for size, accepted, context, seconds, forward in zip(
            stats.tree_sizes,
            stats.accepted_nodes,
            stats.verify_contexts,
            stats.verify_seconds,
            stats.verify_forwards,
            strict=True,
        )
    ]


PRIOR_ROUNDS = 16
"""Weight, in rounds, of a prior estimate of a node rank's gain against the rounds that measured it:
the surrogate's promise against the finished rounds, and that estimate against a sequence's own."""
MIN_TIMED_ROUNDS = 4
"""Rounds of one verified size before their times recalibrate the cost curve."""


class BudgetPlanner:
    """Chooses the DDTree budget from the cost curve and the drafter's recent proposals and rounds.

    Acceptance: best-first order numbers every node after its parent, so a round verified at
    budget B would have accepted, with only its first r <= B nodes, exactly its accepted nodes
    numbered <= r (greedy verification walks the same target choices). The gain of node rank r is
    therefore measured by every recent round that verified r nodes or more, and those measurements
    outweigh the drafter's surrogate as they accumulate (:data:`PRIOR_ROUNDS`). The surrogate,
    scaled by the share of its promise the target confirmed over the upper half of the
    well-measured ranks (at most 1), covers ranks few rounds reached: drafters are rarely
    calibrated, and the nodes past the budget are their weakest guesses. :class:`AutoBudgetBuilder`
    verifies a bigger tree now and then so the ranks just past the budget get measured too.

    Per sequence: the planner learns from finished sequences only, and chooses for one running
    sequence from its own record (:class:`~diffdraft.stats.GenerationStats`): that sequence's
    surrogates replace the recent ones as the prior, and its own verified rounds outweigh the
    finished rounds' estimate as they add up, so sequences the drafter serves well and badly get
    different budgets in one batch, each the one it would get alone.

    Cost: the cached curve was measured once, in isolation, and its shape can differ from what the
    same forwards cost inside a decoding loop (seen here: 0.4 vs 1 ms per extra token on a CPU). The
    recent rounds' verification times, divided by the curve's prediction for their size and
    context, give a scale per verified size; a line through those scales (weighted by rounds,
    constant outside the verified sizes) rescales the curve. The builder verifies smaller and
    bigger trees now and then, so the line's slope is measured around the chosen budget, and a
    recent window keeps machine drift out.
    """

    def __init__(
        self,
        curve: VerifyCostCurve,
        max_budget: int = MAX_BUDGET,
        window: int = 64,
        rounds: int = 256,
        timed_rounds: int = 128,
    ) -> None:
        self.curve = curve
        self.max_budget = min(max_budget, curve.sizes[-1] - 1)  # never extrapolate the cost curve
        self._surrogates: deque[list[float]] = deque(maxlen=window)
        self._rounds: deque[ObservedRound] = deque(maxlen=rounds)
        self._timed: deque[tuple[int, float]] = deque(maxlen=timed_rounds)  # (q, measured / curve)
        self.fixed_seconds = 0.0
        """Seconds per round outside verification (see choose_budget)."""

    @property
    def has_proposals(self) -> bool:
        """Whether finished sequences taught it any proposal (else it knows nothing of acceptance)."""
        return bool(self._surrogates)

    def observe_proposal(self, surrogate: Sequence[float]) -> None:
        self._surrogates.append(self._padded(surrogate))

    def _padded(self, surrogate: Sequence[float]) -> list[float]:
        """``surrogate`` cut or extended (flat) to budgets 0..max_budget."""
        padded = list(surrogate[: self.max_budget + 1])
        return padded + [padded[-1]] * (self.max_budget + 1 - len(padded))

    def observe_rounds(self, rounds: Sequence[ObservedRound], fixed_seconds: float) -> None:
        """Verified rounds, and the mean seconds per round spent outside verification. Only rounds
        verified alone rescale the curve: a shared forward's time is not its tree's."""
        self._rounds.extend(rounds)
        self._timed.extend(
            (r.budget + 1, r.seconds / self.curve(r.budget + 1, r.context))
            for r in rounds
            if r.seconds > 0 and r.forward is None
        )
        self.fixed_seconds = fixed_seconds

    def surrogate(self, sequence: GenerationStats | None = None) -> list[float]:
        """Mean surrogate acceptance per budget over ``sequence``'s own proposals when it has any,
        else over the recent finished ones (1.0 everywhere before any)."""
        if sequence is not None and sequence.surrogates:
            return np.mean([self._padded(s) for s in sequence.surrogates], axis=0).tolist()
        if not self._surrogates:
            return [1.0] * (self.max_budget + 1)
        return np.mean(np.asarray(self._surrogates), axis=0).tolist()

    def cost(self) -> Callable[[float, float], float]:
        """t(q, n): the cached curve rescaled by the recent rounds' own verification times."""
        sizes, scales, counts = self.cost_scales()
        if not sizes:
            return self.curve
        slope, intercept = (
            np.polyfit(sizes, scales, 1, w=np.sqrt(counts)) if len(sizes) > 1 else (0.0, scales[0])
        )
        low, high = sizes[0], sizes[-1]
        return lambda q, context: self.curve(q, context) * (intercept + slope * np.clip(q, low, high))

    def cost_scales(self) -> tuple[list[int], list[float], list[int]]:
        """Verified sizes with enough timed rounds, their median measured / cached-curve time, and
        how many rounds each."""
        ratios: dict[int, list[float]] = {}
        for q, ratio in self._timed:
            ratios.setdefault(q, []).append(ratio)
        sizes = sorted(q for q, seen in ratios.items() if len(seen) >= MIN_TIMED_ROUNDS)
        return sizes, [float(np.median(ratios[q])) for q in sizes], [len(ratios[q]) for q in sizes]

    def rank_gains(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node rank 1..max_budget: summed acceptance gain over the recent rounds that verified
        that rank, and how many did."""
        return _rank_gains(self._rounds, self.max_budget)

    def growth_calibration(self) -> float:
        """Realized / surrogate-promised gain over the upper half of the ranks at least
        :data:`PRIOR_ROUNDS` rounds verified, at most 1; 1 before that."""
        observed, counts = self.rank_gains() if self._rounds else (np.zeros(0), np.zeros(0))
        return _growth(np.diff(self.surrogate()), observed, counts)

    def expected_tau(self, sequence: GenerationStats | None = None) -> list[float]:
        """Expected acceptance length per budget 0..max_budget (see the class docstring), for the
        running ``sequence`` (its record so far) or, without one, for the recent finished rounds."""
        gains = np.diff(self.surrogate(sequence))
        if self._rounds:
            observed, counts = self.rank_gains()
            prior = gains * _growth(np.diff(self.surrogate()), observed, counts)
            gains = (observed + PRIOR_ROUNDS * prior) / (counts + PRIOR_ROUNDS)
        if sequence is not None and sequence.rounds:
            observed, counts = _rank_gains(rounds_of(sequence), self.max_budget)
            gains = (observed + PRIOR_ROUNDS * gains) / (counts + PRIOR_ROUNDS)
        return [1.0, *(1.0 + np.cumsum(gains)).tolist()]

    def describe(self, context: int) -> dict:
        """The planner's current model, for reports: what it expects at each power-of-two budget
        over ``context`` cached tokens."""
        expected_tau = self.expected_tau()
        choice = choose_budget(self.cost(), expected_tau, context, self.fixed_seconds)
        shown = [b for b in choice.expected if b & (b - 1) == 0 or b == choice.budget]
        sizes, scales, _ = self.cost_scales()
        return {
            "context": context,
            "budget": choice.budget,
            "growth_calibration": self.growth_calibration(),
            "cost_scales": dict(zip(sizes, scales, strict=True)),
            "fixed_ms": 1e3 * self.fixed_seconds,
            "expected_tau": {b: expected_tau[b] for b in shown},
            "expected_tokens_per_second": {b: choice.expected[b] for b in shown},
        }


def _rank_gains(rounds: Sequence[ObservedRound], max_budget: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`BudgetPlanner.rank_gains` over ``rounds``."""
    ranks = np.arange(1, max_budget + 1)
    verified = np.array([[r.budget] for r in rounds]).reshape(-1, 1) >= ranks[None, :]
    accepted = np.zeros((len(rounds), max_budget + 1))
    for row, r in enumerate(rounds):
        # accepted node indices rise along the path; the gain of rank r is 1 if node r is on it
        accepted[row, [i for i in r.accepted if i <= min(r.budget, max_budget)]] = 1.0
    return (accepted[:, 1:] * verified).sum(axis=0), verified.sum(axis=0)


def _growth(promised: np.ndarray, observed: np.ndarray, counts: np.ndarray) -> float:
    """:meth:`BudgetPlanner.growth_calibration` from the surrogate's per-rank gains and the rounds'."""
    well = np.flatnonzero(counts >= PRIOR_ROUNDS)  # ranks 1..top: counts fall with the rank
    if not len(well):
        return 1.0
    upper = slice((well[-1] + 1) // 2, well[-1] + 1)
    realized = float((observed[upper] / counts[upper]).sum())
    predicted = float(promised[upper].sum())
    return min(1.0, realized / predicted) if predicted > 1e-6 else 1.0
