"""Lookup boost: copied tokens gain weight w, every row stays a distribution, no match changes nothing."""

from __future__ import annotations

import math

import pytest
import torch

from diffdraft.drafters.base import Proposal
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter


class FixedDrafter:
    target_layer_ids: list[int] = []  # noqa: RUF012
    max_depth = 3

    def __init__(self, log_probs: torch.Tensor) -> None:
        self.log_probs = log_probs

    def reset(self) -> None:
        pass

    def extend_context(self, hidden, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        return Proposal(log_probs=self.log_probs[:depth])


LOG_PROBS = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).log_softmax(-1)


def test_copied_tokens_get_the_lookup_weight_and_rows_stay_distributions():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS), weight=0.5)
    # context "7 1 2 1": lookup copies "2 1", what followed the earlier "1"
    proposal = boosted.propose(torch.tensor([7, 1, 2, 1]), 3)
    probs, base = proposal.log_probs.exp(), LOG_PROBS.exp()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert math.isclose(probs[0, 2], 0.5 * base[0, 2] + 0.5, rel_tol=1e-5)
    assert math.isclose(probs[1, 1], 0.5 * base[1, 1] + 0.5, rel_tol=1e-5)
    torch.testing.assert_close(probs[0, 3:], 0.5 * base[0, 3:])
    torch.testing.assert_close(probs[2], base[2])  # lookup copied two tokens only: depth 3 untouched


def test_without_a_match_the_drafter_proposal_is_unchanged():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    proposal = boosted.propose(torch.tensor([1, 2, 3]), 3)
    torch.testing.assert_close(proposal.log_probs, LOG_PROBS)


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_weights_outside_the_open_unit_interval_are_refused(weight):
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        LookupBoostedDrafter(FixedDrafter(LOG_PROBS), weight=weight)
