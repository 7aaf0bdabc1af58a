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
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache

from diffdraft.default_model import cache_root
from diffdraft.drafters.base import Proposal
from diffdraft.fused_projections import ProjectionSlice
from diffdraft.packed_linear import has_packed_layers
from diffdraft.sampling import SamplingParams
from diffdraft.target import TargetModel
from diffdraft.trees import DDTreeBuilder, DraftTree
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

    def __call__(self, q: float, context: float) -> float:
        """t(q, n), linear between measured points, extrapolated linearly past the largest size and
        context (and flat below the smallest context)."""
        per_context = [_interpolate(q, self.sizes, row) for row in self.seconds]
        return _interpolate(context, self.contexts, per_context)

    def to_dict(self) -> dict:
        return asdict(self)


def _interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    if x > xs[-1] and len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    return float(np.interp(x, xs, ys))


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
    with tqdm(total=points, desc="verify cost t(q, n)", disable=not progress, leave=False) as steps:
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
    tree = _synthetic_tree(tokens.to(target.device))
    begin = time.perf_counter()
    mask = target.attention_mask(cache, tree.ancestor_mask()) if tree.num_nodes else None
    out = target.verify(cache, tree.tokens, tree.position_ids(context), mask, [])
    accept(tree, out.logits, _GREEDY, None)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - begin
    cache.crop(-tokens.shape[0])
    return seconds


def _synthetic_tree(tokens: torch.Tensor) -> DraftTree:
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
        "attention": target.model.config._attn_implementation,
        "stacked": any(isinstance(module, ProjectionSlice) for module in target.model.modules()),
        "cache": type(target.new_cache().layers[0]).__name__,
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
    curve = measure_verify_cost(target, DEFAULT_SIZES, DEFAULT_CONTEXTS, progress=progress)
    folder.mkdir(parents=True, exist_ok=True)
    temporary = file.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
    temporary.replace(file)
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
    curve: VerifyCostCurve,
    expected_tau: Sequence[float],
    context: int,
    fixed_seconds: float = 0.0,
    budgets: Sequence[int] | None = None,
) -> BudgetChoice:
    """The budget B maximizing ``expected_tau[B] / (t(B + 1, context) + fixed_seconds)``.

    ``expected_tau[B]`` is the expected acceptance length with B drafted nodes; candidates default
    to every B it covers. ``context`` is the number of cached tokens the round verifies over.
    ``fixed_seconds`` is the per-round cost outside verification (drafter forward, tree build,
    commit, loop overhead), which barely depends on the budget.
    """
    candidates = budgets or range(1, len(expected_tau))
    expected = {
        b: expected_tau[b] / (curve(b + 1, context) + fixed_seconds)
        for b in candidates
        if b < len(expected_tau)
    }
    if not expected:
        raise ValueError("no candidate budget has an expected acceptance length")
    best = max(expected, key=lambda b: (expected[b], -b))
    return BudgetChoice(best, expected[best], expected)


class BudgetPlanner:
    """Chooses the DDTree budget from the cost curve and the drafter's recent proposals and rounds.

    Expected acceptance per budget comes from what the target actually accepted: best-first order
    numbers every node after its parent, so a round verified at budget B would have accepted, with
    only the first b <= B nodes, exactly its accepted nodes numbered <= b (greedy verification walks
    the same target choices). Those counterfactual lengths are exact below the budgets the rounds
    used; above them the surrogate's promised gain is scaled by the share of its gain over the
    upper half of the used budgets that the target confirmed, at most 1: nodes past the budget are
    the drafter's weakest guesses, and a share above 1 comes from long prompt-lookup copies
    already inside the tree. A single realized / predicted scale for everything would stretch the
    gains of well-predicted top nodes onto the tail, and buy too big trees.
    """

    def __init__(
        self, curve: VerifyCostCurve, max_budget: int = MAX_BUDGET, window: int = 64, rounds: int = 256
    ) -> None:
        self.curve = curve
        self.max_budget = min(max_budget, curve.sizes[-1] - 1)  # never extrapolate the cost curve
        self._surrogates: deque[list[float]] = deque(maxlen=window)
        self._rounds: deque[tuple[int, list[int]]] = deque(maxlen=rounds)  # (budget, accepted nodes)
        self.fixed_seconds = 0.0
        """Seconds per round outside verification (see choose_budget)."""

    def observe_proposal(self, surrogate: Sequence[float]) -> None:
        padded = list(surrogate[: self.max_budget + 1])
        padded += [padded[-1]] * (self.max_budget + 1 - len(padded))
        self._surrogates.append(padded)

    def observe_rounds(
        self, budgets: Sequence[int], accepted_nodes: Sequence[Sequence[int]], fixed_seconds: float
    ) -> None:
        """Rounds verified at ``budgets`` and the best-first indices of the draft nodes each accepted,
        and their cost outside verification."""
        for budget, nodes in zip(budgets, accepted_nodes, strict=False):
            self._rounds.append((min(budget, self.max_budget), list(nodes)))
        self.fixed_seconds = fixed_seconds

    def surrogate(self) -> list[float]:
        """Mean surrogate acceptance per budget over recent proposals (1.0 everywhere before any)."""
        if not self._surrogates:
            return [1.0] * (self.max_budget + 1)
        return np.mean(np.asarray(self._surrogates), axis=0).tolist()

    def _counterfactual(self) -> tuple[np.ndarray, np.ndarray]:
        """Budgets used [R] and acceptance lengths [R, max_budget + 1] of the recent rounds had
        they verified only their first b nodes (their own length for b past their budget)."""
        used = np.array([budget for budget, _ in self._rounds])
        depth = max(1, *(len(nodes) for _, nodes in self._rounds))
        nodes = np.full((len(self._rounds), depth), np.inf)
        for row, (_, accepted) in enumerate(self._rounds):
            nodes[row, : len(accepted)] = accepted
        seen = np.minimum(np.arange(self.max_budget + 1)[None, :], used[:, None])
        return used, 1 + (nodes[:, :, None] <= seen[:, None, :]).sum(axis=1)

    def growth_calibration(self) -> float:
        """Realized / surrogate-predicted acceptance gain from budget B/2 to B over the recent
        rounds (B = each round's budget), at most 1; 1 before any round."""
        if not self._rounds:
            return 1.0
        return _growth(np.asarray(self.surrogate()), *self._counterfactual())

    def expected_tau(self) -> list[float]:
        """Expected acceptance length per budget 0..max_budget (see the class docstring)."""
        surrogate = np.asarray(self.surrogate())
        if not self._rounds:
            return surrogate.tolist()
        used, lengths = self._counterfactual()
        beyond = np.clip(surrogate[None, :] - surrogate[used][:, None], 0.0, None)  # 0 up to B used
        return (lengths + _growth(surrogate, used, lengths) * beyond).mean(axis=0).tolist()

    def choose(self, context: int) -> BudgetChoice:
        return choose_budget(self.curve, self.expected_tau(), context, self.fixed_seconds)

    def describe(self, context: int) -> dict:
        """The planner's current model, for reports: what it expects at each power-of-two budget
        over ``context`` cached tokens."""
        expected_tau = self.expected_tau()
        choice = choose_budget(self.curve, expected_tau, context, self.fixed_seconds)
        shown = [b for b in choice.expected if b & (b - 1) == 0 or b == choice.budget]
        return {
            "context": context,
            "budget": choice.budget,
            "growth_calibration": self.growth_calibration(),
            "fixed_ms": 1e3 * self.fixed_seconds,
            "expected_tau": {b: expected_tau[b] for b in shown},
            "expected_tokens_per_second": {b: choice.expected[b] for b in shown},
        }


def _growth(surrogate: np.ndarray, used: np.ndarray, lengths: np.ndarray) -> float:
    """:meth:`BudgetPlanner.growth_calibration` from the planner's surrogate and counterfactuals."""
    rows = np.arange(len(used))
    realized = float((lengths[rows, used] - lengths[rows, used // 2]).sum())
    predicted = float((surrogate[used] - surrogate[used // 2]).sum())
    return min(1.0, realized / predicted) if predicted > 1e-6 else 1.0


class AutoBudgetBuilder:
    """A DDTree builder whose budget the planner re-chooses every ``refresh`` rounds.

    On a refresh round it builds the largest candidate tree once, feeds its surrogate to the
    planner, and keeps the chosen budget's best-first prefix; other rounds build at the current
    budget directly, so the surrogate's extra cost is paid on one round in ``refresh``.
    """

    def __init__(self, planner: BudgetPlanner, initial_budget: int = 32, refresh: int = 8) -> None:
        self.planner = planner
        self.budget = initial_budget
        self.refresh = refresh
        self.used: list[int] = []
        """Budget of every tree built since the last :meth:`observe_generation`."""
        self._rounds = 0

    def build(
        self,
        root_token: int,
        proposal: Proposal,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        context: int = 0,
    ) -> DraftTree:
        self._rounds += 1
        if self._rounds % self.refresh != 1 or proposal.log_probs is None:
            tree = DDTreeBuilder(self.budget).build(root_token, proposal, sampling, generator)
        else:
            largest = DDTreeBuilder(self.planner.max_budget).build(root_token, proposal, sampling, generator)
            self.planner.observe_proposal(surrogate_acceptance(largest, proposal.log_probs))
            self.budget = self.planner.choose(context).budget
            keep = slice(0, self.budget + 1)  # best-first order: a prefix is the optimal smaller tree
            tree = DraftTree(largest.tokens[keep], largest.parents[keep], largest.depths[keep])
        self.used.append(self.budget)
        return tree

    def observe_generation(self, accepted_nodes: Sequence[Sequence[int]], fixed_seconds: float) -> list[int]:
        """Feed a finished generation back: the draft nodes each round accepted (in order; the
        engine's ``stats.accepted_nodes``) and the mean seconds per round spent outside
        verification. Returns the budgets its rounds used."""
        used, self.used = self.used, []
        self.planner.observe_rounds(used, accepted_nodes, fixed_seconds)
        return used
