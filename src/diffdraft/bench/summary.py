"""From raw records to the figures a reader wants: speed, speedup, acceptance, stage times, bounds.

Speedup is a method's tokens per second over plain AR's on the same prompts in the same repeat,
which equals AR time / method time whenever the outputs are identical and stays fair when a bf16
near-tie changes an output's length. Each figure is the mean over repeats with the min-max spread.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from diffdraft.bench.methods import REFERENCE, STAGE_NAMES, MethodSpec
from diffdraft.bench.records import Record
from diffdraft.budget.cost import VerifyCostCurve

ROUND_STAGES = tuple(s for s in STAGE_NAMES if s != "prefill")
AUTO_TOLERANCE = 0.95
"""Auto must reach this fraction of the best swept budget's tokens per second."""
DDTREE_FAMILIES = ("ddtree", "ddtree+pld")
"""Methods whose tree and verifier are DDTree's (the second with a lookup-boosted drafter)."""


@dataclass
class Spread:
    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(float(np.mean(values)), float(min(values)), float(max(values)))


@dataclass
class MethodSummary:
    method: str
    dataset: str
    temperature: float
    generations: int
    tokens: int
    seconds: float
    tokens_per_second: Spread
    speedup: Spread
    """Over plain AR, per repeat."""
    speedup_vs_hf: float | None
    """Over the fastest Hugging Face greedy ``generate`` entry (any dtype) on the same prompts."""
    rounds: int
    tau: float
    histogram: dict[int, int]
    position_acceptance: list[float]
    """Entry d-1: share of rounds accepting draft position d among those that drafted and reached it."""
    prefill_ms: float
    """Per generation."""
    stage_ms: dict[str, float]
    """Per verification round."""
    mean_verify_tokens: float
    bound: float | None
    """tau * t(1) / (t(q) + t_draft): the speedup if everything but drafting and verifying were free."""
    bound_fraction: float | None
    compared: int = 0
    identical: int = 0
    near_ties: int = 0
    violations: int = 0
    budgets: dict[int, int] = field(default_factory=dict)
    """Rounds per budget (auto budget only)."""
    ngram_lookups_per_round: float = 0.0
    """N-gram trie lookups per round (DART's tree)."""
    ngram_lookup_us: float | None = None
    """Median microseconds of one lookup: the generations' medians, weighted by their lookups."""

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens over the time after each prompt's prefill: the decoding rate alone (engines
        prefill at very different speeds, and tokens/s counts the prefill in)."""
        decoding = self.seconds - self.prefill_ms * self.generations / 1e3
        return self.tokens / decoding if decoding > 0 else float("nan")


@dataclass
class Check:
    """A pass/fail line of the report, e.g. auto budget within 5% of the best swept one."""

    name: str
    dataset: str
    temperature: float
    value: float
    target: float
    passed: bool
    detail: str


def summarize(
    records: Sequence[Record], curve: VerifyCostCurve | None, main_dtype: str
) -> list[MethodSummary]:
    """One summary per (dataset, temperature, method), in first-seen order."""
    groups: dict[tuple[str, float, str], list[Record]] = defaultdict(list)
    for record in records:
        groups[(record.dataset, record.temperature, record.method)].append(record)
    rates = {key: _rates_per_repeat(group) for key, group in groups.items()}
    summaries = []
    for (dataset, temperature, method), group in groups.items():
        mine = rates[(dataset, temperature, method)]
        reference = rates.get((dataset, temperature, REFERENCE))
        speedups = [mine[r] / reference[r] for r in mine if reference and r in reference and reference[r] > 0]
        hf_rate = max(
            (
                float(np.mean(list(values.values())))
                for (d, t, m), values in rates.items()
                if d == dataset and t == temperature and MethodSpec.parse(m).name == "hf"
            ),
            default=0.0,
        )
        summaries.append(_summary(group, mine, speedups, hf_rate, curve, main_dtype))
    return summaries


def _rates_per_repeat(group: Sequence[Record]) -> dict[int, float]:
    tokens: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    for record in group:
        tokens[record.repeat] += len(record.completion.token_ids)
        seconds[record.repeat] += record.completion.seconds
    return {r: tokens[r] / seconds[r] for r in tokens if seconds[r] > 0}


def _summary(
    group: Sequence[Record],
    rates: dict[int, float],
    speedups: list[float],
    hf_rate: float,
    curve: VerifyCostCurve | None,
    main_dtype: str,
) -> MethodSummary:
    first = group[0]
    lengths = [n for record in group for n in record.completion.acceptance_lengths]
    depths = [d for record in group for d in record.completion.draft_depths]
    histogram = dict(sorted(Counter(lengths).items()))
    rounds = len(lengths)
    stages = {s: sum(r.completion.stages.get(s, 0.0) for r in group) for s in STAGE_NAMES}
    sizes = [q for record in group for q in record.completion.verify_sizes]
    contexts = [n for record in group for n in record.completion.verify_contexts]
    tau = sum(lengths) / rounds if rounds else 0.0
    tokens_per_second = Spread.of(list(rates.values()))
    speedup = Spread.of(speedups) if speedups else Spread(float("nan"), float("nan"), float("nan"))
    bound = None
    spec = MethodSpec.parse(first.method)
    if (
        curve is not None
        and sizes
        and rounds
        and len(contexts) == len(sizes)
        and spec.dtype in (None, main_dtype)
        and first.completion.engine == "diffdraft"
    ):
        # t(1) and t(q) at the contexts the rounds actually verified over
        one = float(np.mean([curve(1, n) for n in contexts]))
        verify = float(np.mean([curve(q, n) for q, n in zip(sizes, contexts, strict=True)]))
        bound = tau * one / (verify + stages["draft"] / rounds)
    compared = [r for r in group if r.compared]
    return MethodSummary(
        method=first.method,
        dataset=first.dataset,
        temperature=first.temperature,
        generations=len(group),
        tokens=sum(len(r.completion.token_ids) for r in group),
        seconds=sum(r.completion.seconds for r in group),
        tokens_per_second=tokens_per_second,
        speedup=speedup,
        speedup_vs_hf=tokens_per_second.mean / hf_rate if hf_rate else None,
        rounds=rounds,
        tau=tau,
        histogram=histogram,
        position_acceptance=_position_acceptance(lengths, depths),
        prefill_ms=1e3 * stages["prefill"] / len(group),
        stage_ms={s: 1e3 * stages[s] / rounds for s in ROUND_STAGES} if rounds else {},
        mean_verify_tokens=float(np.mean(sizes)) if sizes else 0.0,
        bound=bound,
        bound_fraction=speedup.mean / bound if bound else None,
        compared=len(compared),
        identical=sum(r.divergence is None for r in compared),
        near_ties=sum(r.divergence is not None and r.divergence["explained"] for r in compared),
        violations=sum(r.divergence is not None and not r.divergence["explained"] for r in compared),
        budgets=dict(sorted(Counter(b for r in group for b in r.completion.budgets).items())),
        ngram_lookups_per_round=sum(r.completion.ngram_lookups for r in group) / rounds if rounds else 0.0,
        ngram_lookup_us=_lookup_median_us(group),
    )


def _lookup_median_us(group: Sequence[Record]) -> float | None:
    """The median of the generations' median lookup times, each weighted by its number of lookups
    (the exact median would need every lookup's time, too many to keep per record)."""
    timed = sorted((r.completion.ngram_lookup_median, r.completion.ngram_lookups) for r in group)
    timed = [(median, count) for median, count in timed if count]
    if not timed:
        return None
    half = sum(count for _, count in timed) / 2
    seen = 0
    for median, count in timed:
        seen += count
        if seen >= half:
            return 1e6 * median
    return 1e6 * timed[-1][0]


def _position_acceptance(lengths: Sequence[int], depths: Sequence[int]) -> list[float]:
    """Acceptance of draft position d among rounds that drafted it (depth >= d) and accepted
    positions 1..d-1 (length >= d); a round of length n accepted positions 1..n-1."""
    longest = max((min(n, depth) for n, depth in zip(lengths, depths, strict=True)), default=0)
    rates = []
    for d in range(1, longest + 1):
        reached = [n for n, depth in zip(lengths, depths, strict=True) if depth >= d and n >= d]
        rates.append(sum(n > d for n in reached) / len(reached) if reached else 0.0)
    return rates


def checks(summaries: Sequence[MethodSummary]) -> list[Check]:
    """The issue's pass/fail lines: every auto budget vs its family's sweep (ddtree, ddtree+pld, deer-tree,
    ...), and DDTree vs the HF baselines and bound.

    The speed lines take the fastest DDTree run, with or without the prompt-lookup boost (the tree
    and verifier are DDTree's either way; the line names the method that set it).
    """
    found = []
    by_condition: dict[tuple[str, float], list[MethodSummary]] = defaultdict(list)
    for summary in summaries:
        by_condition[(summary.dataset, summary.temperature)].append(summary)
    for (dataset, temperature), group in by_condition.items():
        compared = [s for s in group if s.compared]
        if compared:
            bad = sum(s.violations for s in compared)
            detail = f"{sum(s.identical for s in compared)} identical, {sum(s.near_ties for s in compared)} "
            detail += f"near-ties, {bad} unexplained divergences"
            found.append(Check("lossless vs plain AR", dataset, temperature, bad, 0, bad == 0, detail))
        auto_families = {
            MethodSpec.parse(s.method).name for s in group if MethodSpec.parse(s.method).arg == "auto"
        }
        for family in sorted(auto_families):
            found.extend(_auto_check([s for s in group if MethodSpec.parse(s.method).name == family]))
        ddtree = [s for s in group if MethodSpec.parse(s.method).name in DDTREE_FAMILIES]
        if not ddtree or temperature != 0:
            continue
        top = max(ddtree, key=lambda s: s.tokens_per_second.mean)
        for name, target in (("hf", 2.5), ("hf-pld", 1.5)):
            rivals = [s for s in group if MethodSpec.parse(s.method).name == name]
            if rivals:
                rival = max(rivals, key=lambda s: s.tokens_per_second.mean)
                ratio = top.tokens_per_second.mean / rival.tokens_per_second.mean
                detail = f"{top.method} {top.tokens_per_second.mean:.1f} tok/s vs {rival.method} "
                detail += f"{rival.tokens_per_second.mean:.1f} tok/s"
                found.append(
                    Check(
                        f"{top.method} / best {name}",
                        dataset,
                        temperature,
                        ratio,
                        target,
                        ratio >= target,
                        detail,
                    )
                )
        if top.bound_fraction is not None:
            found.append(
                Check(
                    f"{top.method} speedup / physical bound",
                    dataset,
                    temperature,
                    top.bound_fraction,
                    0.85,
                    top.bound_fraction >= 0.85,
                    f"speedup {top.speedup.mean:.2f}x, bound {top.bound:.2f}x",
                )
            )
    return found


def _auto_check(family: list[MethodSummary]) -> list[Check]:
    """``<family>:auto`` against the best budget of the same family swept in the same run."""
    swept = [s for s in family if MethodSpec.parse(s.method).arg != "auto"]
    auto = next((s for s in family if MethodSpec.parse(s.method).arg == "auto"), None)
    if auto is None or not swept:
        return []
    best = max(swept, key=lambda s: s.tokens_per_second.mean)
    ratio = auto.tokens_per_second.mean / best.tokens_per_second.mean
    detail = f"{auto.method} {auto.tokens_per_second.mean:.1f} tok/s vs {best.method} "
    detail += f"{best.tokens_per_second.mean:.1f} tok/s"
    name = f"{MethodSpec.parse(auto.method).name}:auto / best swept"
    passed = ratio >= AUTO_TOLERANCE
    return [Check(name, auto.dataset, auto.temperature, ratio, AUTO_TOLERANCE, passed, detail)]
