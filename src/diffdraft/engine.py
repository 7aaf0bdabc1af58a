"""The speculative loop: draft, build a tree, verify it in one target forward, keep what is accepted.

One loop serves every method; drafters, tree builders and verifiers are plugged in. Plain
autoregressive decoding is the same loop with no drafter (every tree is just the root).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from diffdraft.drafters.base import Drafter, Proposal
from diffdraft.sampling import SamplingParams, greedy_tokens, sample_from
from diffdraft.stats import GenerationStats, StageTimer
from diffdraft.stopping import StopConditions
from diffdraft.target import TargetModel
from diffdraft.trees import DraftTree, TreeBuilder
from diffdraft.verify import accept


class SpeculativeEngine:
    def __init__(self, target: TargetModel, drafter: Drafter | None, builder: TreeBuilder) -> None:
        self.target = target
        self.drafter = drafter
        self.builder = builder
        self.layer_ids = list(drafter.target_layer_ids) if drafter is not None else []
        target.check_layer_ids(self.layer_ids)
        if drafter is not None:
            target.check_speculation_supported()

    def run(
        self,
        prompt_ids: list[int],
        stop: StopConditions,
        sampling: SamplingParams,
        stats: GenerationStats,
        seed: int | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens committed by the prefill and by each round, until a stop condition holds."""
        begin = time.perf_counter()
        timer = StageTimer(stats, self.target.device)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.target.device).manual_seed(seed)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.target.device)
        cache = self.target.new_cache()
        if self.drafter is not None:
            self.drafter.reset()

        with timer("prefill"):
            out = self.target.prefill(cache, ids, self.layer_ids)
            if self.drafter is not None:
                self.drafter.extend_context(out.hidden, 0)
            first = self._pick(out.logits[-1], sampling, generator)
        generated = [first]
        decision = stop.check(generated, 1)
        yield [first]

        while decision is None:
            start = len(prompt_ids) + len(generated) - 1  # absolute position of the root
            all_ids = torch.cat([ids, torch.tensor(generated, device=ids.device)])
            depth = min(self.drafter.max_depth if self.drafter else 0, stop.remaining(len(generated)) - 1)
            with timer("draft"):
                proposal = self.drafter.propose(all_ids, depth) if depth > 0 else Proposal()
                proposal.prefix = all_ids
            with timer("tree"):
                tree = self._build(generated[-1], proposal, sampling, generator, start)
            with timer("mask"):
                mask = self.target.attention_mask(cache, tree.ancestor_mask()) if tree.num_nodes else None
            with timer("verify"):
                out = self.target.verify(cache, tree.tokens, tree.position_ids(start), mask, self.layer_ids)
            stats.verify_seconds.append(timer.last)
            with timer("accept"):
                result = accept(tree, out.logits, sampling, generator)
            with timer("commit"):
                self.target.keep_path(cache, start, result.path)
                if self.drafter is not None:
                    hidden = out.hidden[result.path] if out.hidden is not None else None
                    self.drafter.extend_context(hidden, start)
                new = [*tree.tokens[result.path[1:]].tolist(), result.next_token]
            stats.rounds += 1
            stats.acceptance_lengths.append(len(new))
            stats.accepted_nodes.append(result.path[1:])
            stats.draft_depths.append(proposal.depth)
            stats.tree_sizes.append(tree.num_nodes)
            generated.extend(new)
            decision = stop.check(generated, len(new))
            if decision is not None:
                new = new[: max(0, len(new) - (len(generated) - decision.keep))]
            yield new

        stats.stop_reason = decision.reason
        stats.total_seconds = time.perf_counter() - begin

    def _build(
        self,
        root: int,
        proposal: Proposal,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        context: int,
    ) -> DraftTree:
        if proposal.depth == 0:
            return DraftTree.root_only(root, self.target.device)
        return self.builder.build(root, proposal, sampling, generator, context)

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
        if sampling.greedy:
            return int(greedy_tokens(logits))
        return int(sample_from(sampling.probs(logits), generator))
