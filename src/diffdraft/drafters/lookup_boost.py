"""A distribution drafter boosted by prompt lookup: the copied continuation joins its proposal.

Code and chat answers repeat their context (identifiers, quoted text); prompt lookup finds those
repeats for free, while a small drafter guesses everything else. Where lookup finds a match,
depth d's marginal becomes ``(1 - w) * q_d + w * onehot(copy_d)``: with w = 1/2 the copied chain
leads DDTree's best-first order and the chain's argmax, and the drafter's own guesses fill the
rest of the budget. Every row stays a probability distribution, so all verifiers stay exact.
"""

from __future__ import annotations

import math

import torch

from diffdraft.drafters.base import Drafter, Proposal
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter


class LookupBoostedDrafter:
    def __init__(
        self, drafter: Drafter, lookup: PromptLookupDrafter | None = None, weight: float = 0.5
    ) -> None:
        if not 0.0 < weight < 1.0:
            raise ValueError(f"lookup weight must be in (0, 1), got {weight}")
        self.drafter = drafter
        self.lookup = lookup or PromptLookupDrafter(max_depth=drafter.max_depth)
        self.weight = weight
        self.target_layer_ids = drafter.target_layer_ids
        self.max_depth = drafter.max_depth

    def reset(self) -> None:
        self.drafter.reset()

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        self.drafter.extend_context(hidden, start)

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        proposal = self.drafter.propose(token_ids, depth)
        copied = self.lookup.propose(token_ids, depth).tokens[: proposal.depth]
        if copied.numel() == 0:
            return proposal
        rows = torch.arange(copied.shape[0], device=proposal.log_probs.device)
        copied = copied.to(proposal.log_probs.device)
        # log((1 - w) q + w * onehot) without leaving log space for the untouched entries
        mixed = proposal.log_probs.clone()
        mixed[rows] += math.log1p(-self.weight)
        boosted = torch.logaddexp(
            mixed[rows, copied], torch.tensor(math.log(self.weight), device=mixed.device)
        )
        mixed[rows, copied] = boosted
        return Proposal(log_probs=mixed)
