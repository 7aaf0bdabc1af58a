"""A distribution drafter boosted by prompt lookup: the copied continuation joins its proposal.

Code and chat answers repeat their context (identifiers, quoted text); prompt lookup finds those
repeats for free, while a small drafter guesses everything else. Where lookup finds a match, depth
d's marginal becomes ``(1 - w) * q_d + w * onehot(copy_d)``. By default w is calibrated on the
current generation, per matched n-gram length n and depth d: the share of earlier such copies the
target confirmed (given the shallower ones were), starting from 1/2, or for a drafter that remembers
(an auto budget's) from what the copies of its earlier generations taught
(:mod:`~diffdraft.drafters.copy_calibration`).
DDTree's tree is optimal for the marginals it is given, so marginals that say how often a copy
really holds spend its budget better than a fixed w (1-gram matches are weak evidence, 3-gram ones
strong); on the default drafter calibrated weights gained acceptance on code and held even on chat
(docs/decisions.md, "copy weights calibrated per n-gram and depth"). Every row stays a probability
distribution, so all verifiers stay exact whatever the weights.

A copy may run past the drafter's block (some rounds fill the block, while prompt lookup alone goes
on copying past it): there the copied token gets w and the rest of the row is spread evenly over the
tokens the drafter scores, so the tree can follow a long copy while the drafter covers its start.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from diffdraft.drafters.base import CopyOffer, Drafter, Proposal, drafts_across_gaps, propose_together
from diffdraft.drafters.copy_calibration import CopyCalibration, CopyRecord
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter

COPY_DEPTH = 10
"""How far a copied continuation may reach by default (prompt lookup's own default depth)."""


class LookupBoostedDrafter:
    def __init__(
        self,
        drafter: Drafter,
        lookup: PromptLookupDrafter | None = None,
        weight: float | None = None,
        remember: bool = False,
    ) -> None:
        """``weight``: a fixed w for every depth, or None to calibrate w_d on each generation, from 1/2
        or, if it should ``remember``, from the record of its and its forks' earlier generations. An
        auto budget's drafter remembers: its round plan takes a copy only where the copy's weights say
        it pays. Others do not, so a seeded request's output never depends on the requests before it."""
        if weight is not None and not 0.0 < weight < 1.0:
            raise ValueError(f"lookup weight must be in (0, 1), got {weight}")
        self.drafter = drafter
        self.lookup = lookup or PromptLookupDrafter(max_depth=max(drafter.max_depth, COPY_DEPTH))
        self.target_layer_ids = drafter.target_layer_ids
        self.max_depth = max(drafter.max_depth, self.lookup.max_depth)
        shape = (self.lookup.max_ngram + 1, self.max_depth)
        self.calibration = CopyCalibration(shape, weight, CopyRecord(shape) if remember else None)
        self.reset()

    def fork(self) -> LookupBoostedDrafter:
        """A drafter of its own over forks of this one's drafter and lookup, sharing its weight and its
        record (every fork adds to the one record, and starts from it)."""
        clone = copy.copy(self)
        clone.drafter, clone.lookup = self.drafter.fork(), self.lookup.fork()
        clone.calibration = copy.copy(self.calibration)  # the same weight and record
        clone.reset()  # the generation's own state, none of it shared
        return clone

    def reset(self) -> None:
        self.drafter.reset()
        self.calibration.reset()
        self._ceiling: tuple[tuple[int, int], list[float]] | None = None

    def weights(self, ngram: int | slice, depth: int) -> np.ndarray:
        """The copy weights of :meth:`CopyCalibration.weights`."""
        return self.calibration.weights(ngram, depth)

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        self.drafter.extend_context(hidden, start)

    def tolerates_gaps(self) -> bool:
        """The inner drafter's answer (prompt lookup reads the tokens, never the target's states)."""
        return drafts_across_gaps(self.drafter)

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        inner = self.drafter.propose(token_ids, min(depth, self.drafter.max_depth))
        return self._boost(token_ids, inner, depth)

    def propose_batch(
        self, forks: Sequence[LookupBoostedDrafter], token_ids: Sequence[torch.Tensor], depths: Sequence[int]
    ) -> list[Proposal]:
        """The inner drafters' proposals together (one forward where their family can), each boosted
        by its own fork's lookup."""
        inner = [fork.drafter for fork in forks]
        inner_depths = [min(depth, drafter.max_depth) for drafter, depth in zip(inner, depths, strict=True)]
        drafted = propose_together(inner, token_ids, inner_depths)
        return [
            fork._boost(ids, proposal, depth)
            for fork, ids, proposal, depth in zip(forks, token_ids, drafted, depths, strict=True)
        ]

    def copy_offer(self, token_ids: list[int], depth: int) -> CopyOffer | None:
        """Prompt lookup's copy alone, for a round without the drafter's tree: the target keeps copy
        token d with probability w_d once it kept the ones before (:meth:`weights`), so its first k
        tokens are expected to add w_1 + w_1 w_2 + ... + w_1 ... w_k tokens."""
        ngram, follow = self.lookup.match(token_ids, min(depth, self.lookup.max_depth))
        if not follow:
            return None
        return CopyOffer(follow, ngram, self.calibration.expected(ngram, len(follow)))

    def copy_ceiling(self, depth: int) -> list[float]:
        """What a copy of up to ``depth`` tokens would expect were every copied token kept with the
        best weight any n-gram length has at its depth: no offer can expect more (recomputed only
        when a copy was scored since)."""
        depth = min(depth, self.lookup.max_depth)
        key = (depth, self.calibration.scorings)
        if self._ceiling is None or self._ceiling[0] != key:
            best = self.weights(slice(self.lookup.min_ngram, self.lookup.max_ngram + 1), depth).max(axis=0)
            self._ceiling = (key, [1.0, *(1.0 + best.cumprod().cumsum()).tolist()])
        return self._ceiling[1]

    def take_copy(self, offer: CopyOffer, length: int, token_ids: list[int]) -> Proposal:
        """The offer's first ``length`` tokens; the whole copy is scored against what the target
        emits, as a copy that boosted a proposal is."""
        self.calibration.score(token_ids)
        self.calibration.copied(len(token_ids) - 1, offer.ngram, offer.tokens)
        return Proposal(tokens=torch.tensor(offer.tokens[:length], dtype=torch.long))

    @torch.inference_mode()
    def _boost(self, token_ids: torch.Tensor, proposal: Proposal, depth: int) -> Proposal:
        """``proposal`` (the inner drafter's, for the same tokens) with lookup's copy mixed in."""
        ids = token_ids.tolist()
        self.calibration.score(ids)
        ngram, follow = self.lookup.match(ids, min(depth, self.lookup.max_depth))
        self.calibration.copied(len(ids) - 1, ngram, follow)
        if not follow:
            return proposal
        beyond = len(follow) - proposal.depth
        if beyond > 0:  # past the drafter's block only the copy speaks; q is uniform there
            proposal = proposal.extended(beyond)
        # the scores, mixed in place: the inner drafter's fresh ones (its draft vocabulary's columns,
        # widened by any copied token outside it: rows a third as wide as the whole vocabulary's)
        mixed, copied = proposal.scores_of(follow)
        copy_rows = mixed[: len(follow)]
        weight = torch.from_numpy(self.weights(ngram, len(follow))).to(mixed.device)
        # log((1 - w) q + w * onehot) without leaving log space for the untouched entries
        copy_rows += torch.log1p(-weight).to(mixed.dtype)[:, None]
        rows = torch.arange(len(follow), device=mixed.device)
        copy_rows[rows, copied] = torch.logaddexp(copy_rows[rows, copied], weight.log().to(mixed.dtype))
        return proposal
