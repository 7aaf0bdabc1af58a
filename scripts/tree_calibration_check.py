"""Would calibrating the drafter's probabilities build better DDTrees? An upper bound, measured.

DDTree ranks prefixes by the product of the drafter's per-depth marginals. If those marginals were
miscalibrated (a depth over- or underconfident), a per-depth temperature or offset would reshape
the tree and accept more. This script records the drafter's proposal at every position of the
target's greedy continuation of each prompt, then replays DDTree offline: under greedy decoding a
tree accepts exactly the longest prefix of the target's continuation it holds, so any tree rule is
scored without another target forward. The calibration is fitted on the very rounds it is scored
on, so its gain is an upper bound on what calibration can give.

    python scripts/tree_calibration_check.py --datasets humaneval,mtbench,sharegpt --samples 30 \
        --out benchmarks/drafter-ablation/tree-calibration.json
"""

from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffdraft.bench.datasets import load_samples
from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.base import Drafter
from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.families import make_drafter
from diffdraft.runtime.chat import encode_chat
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree, TreeRound
from diffdraft.util.progress import progress_bar

TOP_K = 64
"""Candidates kept per depth: more than any 32-node tree uses (DDTree's Lemma 1: at most B per depth)."""
TEMPERATURES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0)
OFFSETS = (-0.5, -0.25, 0.25, 0.5)


@dataclass
class Rounds:
    """One greedy continuation and the drafter's proposal at each of its tokens as the root."""

    tokens: list[int]
    values: np.ndarray  # [rounds, depth, TOP_K] top log-probs
    indices: np.ndarray  # [rounds, depth, TOP_K] their token ids
    log_normalizers: np.ndarray  # [rounds, depth, len(TEMPERATURES)] logsumexp(log_probs / T)


class RecordingBuilder:
    """Records each proposal and drafts nothing, so every round commits exactly one token."""

    def __init__(self, rounds: int, depth: int) -> None:
        self.values = np.zeros((rounds, depth, TOP_K), np.float32)
        self.indices = np.zeros((rounds, depth, TOP_K), np.int64)
        self.log_normalizers = np.zeros((rounds, depth, len(TEMPERATURES)), np.float32)
        self.count = 0
        self.depth = depth

    def build(self, tree_round: TreeRound) -> DraftTree:
        log_probs = tree_round.proposal.log_probs.float()
        if log_probs.shape[0] == self.depth:  # the last rounds draft less: left out
            top = log_probs.topk(TOP_K, dim=-1)
            self.values[self.count] = top.values.cpu().numpy()
            self.indices[self.count] = top.indices.cpu().numpy()
            # at T = 1 the log-probs are normalized already: an exact 0 keeps the raw tree's ties
            zero = torch.zeros(self.depth, device=log_probs.device)
            scaled = [torch.logsumexp(log_probs / t, dim=-1) if t != 1.0 else zero for t in TEMPERATURES]
            self.log_normalizers[self.count] = torch.stack(scaled, -1).cpu().numpy()
            self.count += 1
        return DraftTree.root_only(tree_round.root_token, log_probs.device)


@torch.inference_mode()
def record(
    target: TargetModel, drafter: Drafter, tokenizer, dataset: str, samples: int, new_tokens: int
) -> list[Rounds]:
    recorded = []
    for sample in progress_bar(load_samples(dataset, samples), desc=f"record {dataset}", unit="prompt"):
        prompt = encode_chat(tokenizer, sample.messages)
        builder = RecordingBuilder(new_tokens, drafter.max_depth)
        engine = SpeculativeEngine(target, drafter, builder)
        stop = StopConditions([], new_tokens, target.max_context, len(prompt))
        tokens = [t for chunk in engine.run(SequenceSpec(prompt, stop)) for t in chunk]
        n = builder.count
        recorded.append(Rounds(tokens, builder.values[:n], builder.indices[:n], builder.log_normalizers[:n]))
    return recorded


Calibration = list[tuple[int, float]]
"""Per depth: (index into TEMPERATURES, additive log-score offset)."""


def accepted(rounds: Rounds, start: int, calibration: Calibration, budget: int) -> int:
    """Tokens the round rooted at ``start`` accepts (bonus included) with DDTree over calibrated scores.

    The tree holds the true prefix of length m iff its m-th node is popped within the budget, so
    this pops DDTree's best-first heap (Algorithm 1, ``DDTreeBuilder``'s order) and follows the true
    path without building the tree: several times faster, and the same on 671 of 672 rounds checked against
    ``DDTreeBuilder`` (the other differs in how a tie between equal scores is broken).
    """
    ranked = [
        (rounds.values[start, d] / TEMPERATURES[t] - rounds.log_normalizers[start, d, t] + offset).tolist()
        for d, (t, offset) in enumerate(calibration)
    ]
    truth = rounds.tokens[start + 1 : start + 1 + len(ranked)]
    true_rank = [_rank(rounds.indices[start, d], token) for d, token in enumerate(truth)]
    if not true_rank or true_rank[0] < 0:
        return 1
    path, scores = {0}, [0.0]
    heap = [(-ranked[0][0], 0, 0, 0)]  # (-prefix score, parent node, depth - 1, rank at that depth)
    while heap and len(scores) <= budget:
        negative, parent, depth, rank = heapq.heappop(heap)
        scores.append(-negative)
        node = len(scores) - 1
        if parent in path and depth == len(path) - 1 and rank == true_rank[depth]:
            path.add(node)
            if len(path) - 1 == len(truth) or true_rank[len(path) - 1] < 0:
                break
        if rank + 1 < TOP_K:
            heapq.heappush(heap, (-(scores[parent] + ranked[depth][rank + 1]), parent, depth, rank + 1))
        if depth + 1 < len(ranked):
            heapq.heappush(heap, (-(scores[node] + ranked[depth + 1][0]), node, depth + 1, 0))
    return len(path)


def _rank(candidates: np.ndarray, token: int) -> int:
    """The token's rank among a depth's candidates, or -1 when it is not one of them."""
    ranks = np.flatnonzero(candidates == token)
    return int(ranks[0]) if len(ranks) else -1


def mean_acceptance(recorded: list[Rounds], calibration: Calibration, budget: int) -> float:
    """Mean accepted length with every recorded position as a round's root."""
    lengths = [accepted(r, s, calibration, budget) for r in recorded for s in range(len(r.values))]
    return sum(lengths) / len(lengths)


def fit(recorded: list[Rounds], depth: int, budget: int) -> dict:
    """The raw tree, the best single temperature, then per-depth temperatures and offsets by one
    sweep of coordinate ascent, all on these rounds."""
    raw = [(TEMPERATURES.index(1.0), 0.0)] * depth
    result = {"raw": mean_acceptance(recorded, raw, budget)}
    score, index = max(
        (mean_acceptance(recorded, [(i, 0.0)] * depth, budget), i) for i in range(len(TEMPERATURES))
    )
    result |= {"one_temperature": TEMPERATURES[index], "one_temperature_acceptance": score}
    calibration = [(index, 0.0)] * depth
    for d in range(depth):
        trials = [(i, calibration[d][1]) for i in range(len(TEMPERATURES))]
        trials += [(calibration[d][0], calibration[d][1] + o) for o in OFFSETS]
        for trial in trials:
            candidate = [*calibration[:d], trial, *calibration[d + 1 :]]
            if (value := mean_acceptance(recorded, candidate, budget)) > score:
                score, calibration = value, candidate
    result |= {
        "per_depth": [{"temperature": TEMPERATURES[i], "offset": o} for i, o in calibration],
        "per_depth_acceptance": score,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--datasets", default="humaneval,mtbench,sharegpt")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_target(args.target, dtype=args.dtype, optimize=True)
    target = TargetModel(loaded.model)
    drafter = make_drafter(load_draft_model(args.drafter), target)
    results = {"command": vars(args) | {"out": str(args.out)}, "datasets": {}}
    for dataset in args.datasets.split(","):
        recorded = record(target, drafter, loaded.tokenizer, dataset, args.samples, args.max_new_tokens)
        rows = {"rounds": sum(len(r.values) for r in recorded)}
        for budget in args.budgets:
            rows[f"ddtree-{budget}"] = fit(recorded, drafter.max_depth, budget)
            print(dataset, budget, json.dumps(rows[f"ddtree-{budget}"]), flush=True)
        results["datasets"][dataset] = rows
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
