"""Several sequences through the speculative loop at once, with one target forward per round.

Every sequence keeps its own KV cache, drafter context (a fork of the engine's drafter: shared
weights), random stream, tree and statistics; a round plans every sequence's budget together when
the tree builder plans rounds (the auto budget: a sequence may skip drafting when speculation does
not pay), drafts every drafting sequence in one drafter call (one forward for the DFlash / DFlare
family), builds each tree, verifies all trees in one packed forward
(:meth:`TargetModel.verify_batch`), then accepts and commits per sequence. Sequences join between
rounds (their prompt is prefilled when they join) and leave when they stop or are cancelled:
continuous batching. Because each sequence sees only its own cache and its own random stream, its
output is the one it would get alone (its tree sizes may differ: the plan weighs the whole batch).

For the same reason one sequence's failure in its own part of a round (building its tree, accepting
and committing) need not end the others': a server passes ``on_failure`` to :meth:`BatchEngine.step`,
so a request that fails (a sampler error, a stop check) fails alone and the batch goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from diffdraft.decoding.engine import SequenceRun, SpeculativeEngine, draft_proposals
from diffdraft.decoding.sequence_spec import SequenceSpec


class BatchEngine:
    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.active: list[SequenceRun] = []
        """Sequences still generating, in the order they joined."""

    def add(self, spec: SequenceSpec) -> tuple[SequenceRun, list[int]]:
        """Prefill a new sequence and let it join the next round; returns it and its first token
        (it does not join when that token already ends it)."""
        drafter = self.engine.drafter.fork() if self.engine.drafter is not None else None
        sequence = self.engine.start(spec, drafter)
        first = sequence.prefill()
        if not sequence.done:
            self.active.append(sequence)
        return sequence, first

    def remove(self, sequence: SequenceRun) -> None:
        """Drop a sequence before it stops (its request was cancelled); its cache is freed with it."""
        if sequence in self.active:
            self.active.remove(sequence)

    def step(
        self, on_failure: Callable[[SequenceRun, Exception], None] | None = None
    ) -> list[tuple[SequenceRun, list[int]]]:
        """One round for every active sequence: (sequence, tokens it committed) each; sequences that
        stopped leave the batch. With ``on_failure``, a sequence whose own part of the round raises
        leaves the batch and goes to ``on_failure`` with the error, and the round goes on without it;
        without, the error propagates. A failure in a shared part (the plan, the drafter's call, the
        target's forward) propagates either way: it is every sequence's."""
        sequences = list(self.active)
        if not sequences:
            return []
        plans = self.engine.plan(sequences)
        proposals = draft_proposals(sequences, plans)
        built = []
        for sequence, proposal, plan in zip(sequences, proposals, plans, strict=True):
            verify_input = self._own_part(sequence, on_failure, sequence.build, proposal, plan.budget)
            if verify_input is not None:
                built.append((sequence, verify_input, plan))
        if not built:
            return []
        sequences = [sequence for sequence, _, _ in built]
        inputs = [verify_input for _, verify_input, _ in built]
        contexts = [sequence.context for sequence in sequences]
        target = self.engine.target
        begin = time.perf_counter()
        outputs = target.verify_batch(inputs, self.engine.round_layer_ids([plan for _, _, plan in built]))
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        tokens = sum(i.token_ids.shape[0] for i in inputs)
        forward = (len(inputs), tokens, round(sum(contexts) / len(contexts)))
        committed = []
        for sequence, output in zip(sequences, outputs, strict=True):
            sequence.stats.timings["verify"] += seconds  # the shared forward, as each sequence waited for it
            new = self._own_part(sequence, on_failure, sequence.commit, output, seconds, forward)
            if new is not None:
                committed.append((sequence, new))
        self.active = [sequence for sequence in self.active if not sequence.done]
        return committed

    def _own_part(
        self,
        sequence: SequenceRun,
        on_failure: Callable[[SequenceRun, Exception], None] | None,
        work: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """``work(*args)``, one sequence's own part of a round; None when it raised and ``on_failure``
        took the error (the sequence has left the batch)."""
        if on_failure is None:
            return work(*args)
        try:
            return work(*args)
        except Exception as error:
            self.remove(sequence)
            on_failure(sequence, error)
            return None
