"""Lookup boost: copied tokens gain weight w, every row stays a distribution, no match changes nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffdraft.drafters.base import Proposal, vocab_columns
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter

from diffdraft_testing.conditionals import random_table, table_proposal
from diffdraft_testing.drafters import forks_with_contexts, tiny_drafter
from diffdraft_testing.targets import tiny_target


class FixedDrafter:
    target_layer_ids: list[int] = []  # noqa: RUF012
    max_depth = 3

    def __init__(self, log_probs: torch.Tensor) -> None:
        self.log_probs = log_probs

    def reset(self) -> None:
        pass

    def fork(self) -> FixedDrafter:
        return self  # no state of its own

    def extend_context(self, hidden, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        return Proposal(log_probs=self.log_probs[:depth].clone())  # proposals are handed over


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


class RestrictedDrafter(FixedDrafter):
    """Scores a draft vocabulary only, as DFlash / DART heads with ``draft_vocab_size`` do."""

    VOCAB = torch.tensor([5, 1, 2, 7])

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        scored = self.log_probs[:depth].clone()
        return Proposal.restricted(scored, self.VOCAB, 8, vocab_columns(self.VOCAB))


@pytest.mark.parametrize("context", [[7, 1, 2, 1], [4, 1, 3, 1]])
def test_a_restricted_proposal_is_boosted_as_its_full_rows_would_be(context):
    """A copy of draft-vocabulary tokens is mixed into the scored columns; one that leaves the
    vocabulary ("3") into them widened by its column: the rows are never written out, and they
    hold the full rows' numbers."""
    log_probs = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    restricted = LookupBoostedDrafter(RestrictedDrafter(log_probs), weight=0.5)
    proposal = restricted.propose(torch.tensor(context), 3)
    full_rows = Proposal.restricted(log_probs.clone(), RestrictedDrafter.VOCAB, 8).log_probs
    full = LookupBoostedDrafter(FixedDrafter(full_rows), weight=0.5).propose(torch.tensor(context), 3)
    assert proposal._log_probs is None
    torch.testing.assert_close(proposal.log_probs, full.log_probs, rtol=0, atol=0)
    for k in (1, 3):
        for ours, theirs in zip(proposal.top(k), full.top(k), strict=True):
            assert torch.equal(ours, theirs)


def test_without_a_match_the_drafter_proposal_is_unchanged():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    proposal = boosted.propose(torch.tensor([1, 2, 3]), 3)
    torch.testing.assert_close(proposal.log_probs, LOG_PROBS)


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_weights_outside_the_open_unit_interval_are_refused(weight):
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        LookupBoostedDrafter(FixedDrafter(LOG_PROBS), weight=weight)


def test_calibrated_weights_follow_how_often_the_target_confirmed_earlier_copies():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    assert boosted.weights(1, 3).tolist() == [0.5, 0.5, 0.5]  # no evidence yet
    # "1 2 3 4 0 1": a 1-gram match copies "2 3 4"; the target then emits "2 3 5"
    context = [1, 2, 3, 4, 0, 1]
    boosted.propose(torch.tensor(context), 3)
    boosted.propose(torch.tensor([*context, 2, 3, 5]), 3)
    # depth 1 and 2 confirmed once (2/3), depth 3 missed once (1/3); 2-gram matches untouched
    assert boosted.weights(1, 3).tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert boosted.weights(2, 3).tolist() == [0.5, 0.5, 0.5]
    boosted.reset()  # a new generation starts from no evidence (the drafter does not remember)
    assert boosted.weights(1, 3).tolist() == [0.5, 0.5, 0.5]


def test_a_generation_of_a_remembering_drafter_starts_from_what_every_fork_taught():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS), remember=True)
    first, second = boosted.fork(), boosted.fork()
    context = [1, 2, 3, 4, 0, 1]  # a 1-gram match copies "2 3 4"
    for _ in range(3):  # three generations of the first fork: the target kept "2 3", never "4"
        first.reset()
        first.propose(torch.tensor(context), 3)
        first.propose(torch.tensor([*context, 2, 3, 5]), 3)
    assert second.weights(1, 3).tolist() == [0.5, 0.5, 0.5]  # its generation began before any of them
    second.reset()
    assert second.weights(1, 3).tolist() == pytest.approx([4 / 5, 4 / 5, 1 / 5])  # (3 + 1) / (3 + 2)...
    second.propose(torch.tensor(context), 3)
    second.propose(torch.tensor([*context, 5]), 3)  # ...then its own copy missed at depth 1
    prior = 2 * 4 / 5
    assert second.weights(1, 1).tolist() == pytest.approx([prior / 3])  # two prior copies and its one
    assert LookupBoostedDrafter(FixedDrafter(LOG_PROBS), weight=0.3).fork().weights(1, 2).tolist() == [
        0.3,
        0.3,
    ]


def test_the_copy_record_forgets_half_its_checks_once_a_window_is_full():
    from diffdraft.drafters.copy_calibration import CopyRecord

    record = CopyRecord((2, 1), window=4)
    for _ in range(4):
        record.add(1, 0, kept=True)
    assert record.rates()[1, 0] == pytest.approx(5 / 6)
    record.add(1, 0, kept=False)  # 4 of 4 halved to 2 of 2, then a miss: 2 kept of 3
    assert (record.confirmed[1, 0], record.checked[1, 0]) == (2, 3)
    assert record.rates()[0, 0] == 0.5  # nothing checked there


def test_calibrated_boost_keeps_every_row_a_distribution():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    context = [1, 2, 3, 4, 0, 1]
    boosted.propose(torch.tensor(context), 3)
    proposal = boosted.propose(torch.tensor([*context, 2, 3, 5, 0, 1]), 3)
    torch.testing.assert_close(proposal.log_probs.exp().sum(-1), torch.ones(3, dtype=LOG_PROBS.dtype))


def test_a_copy_longer_than_the_drafter_block_extends_the_proposal():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS), weight=0.5)
    assert boosted.max_depth == 10  # the drafter covers 3 positions, a copy up to 10
    # context "1 2 3 4 5 0 1 2": the 2-gram "1 2" copies "3 4 5 0 1 2", six tokens
    proposal = boosted.propose(torch.tensor([1, 2, 3, 4, 5, 0, 1, 2]), 8)
    probs = proposal.log_probs.exp()
    assert proposal.depth == 6
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    rows, within = torch.arange(3), torch.tensor([3, 4, 5])
    torch.testing.assert_close(probs[rows, within], 0.5 * LOG_PROBS.exp()[rows, within] + 0.5)
    for row, copied in zip(probs[3:], [0, 1, 2], strict=True):  # past the block: w + (1 - w) / V
        assert math.isclose(row[copied], 0.5 + 0.5 / 6, rel_tol=1e-5)
        assert math.isclose(row.min(), 0.5 / 6, rel_tol=1e-5)
    assert boosted.propose(torch.tensor([1, 2, 3, 4, 5, 0, 1, 2]), 4).depth == 4  # the engine's cap holds


def test_past_the_block_a_restricted_proposal_spreads_the_rest_over_its_scored_tokens():
    boosted = LookupBoostedDrafter(RestrictedDrafter(LOG_PROBS[:, :4].log_softmax(-1)), weight=0.5)
    # "1 2" copies "5 0 1 2": depth 4 lies past the block of 3; "0" is outside the vocabulary
    proposal = boosted.propose(torch.tensor([1, 2, 5, 0, 1, 2]), 5)
    assert proposal.depth == 4 and proposal._log_probs is None
    probs = proposal.log_probs.exp()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    row = probs[3]  # the copied "2" gets w plus its even share of the rest over the 4 scored tokens
    assert math.isclose(row[2], 0.5 + 0.5 / 4, rel_tol=1e-5)
    assert math.isclose(row[5], 0.5 / 4, rel_tol=1e-5) and row[0] == 0 and row[3] == 0
    assert math.isclose(probs[1, 0], 0.5, rel_tol=1e-5)  # "0" at depth 2: the copy's weight alone


def test_boosted_forks_draft_together_as_each_alone():
    from diffdraft.drafters.base import propose_together
    from diffdraft.drafters.dflash import DFlashDrafter
    from diffdraft.target.model import TargetModel

    target = tiny_target("llama", seed=4)
    boosted = LookupBoostedDrafter(DFlashDrafter(tiny_drafter(target, block_size=4), TargetModel(target)))
    forks, token_ids = forks_with_contexts(boosted, [11, 6], 4, target.config.hidden_size)
    alone, _ = forks_with_contexts(boosted, [11, 6], 4, target.config.hidden_size)
    token_ids[0] = torch.tensor([5, 6, 7, 8, 1, 2, 3, 4, 9, 5, 6, 7])  # "5 6 7" repeats: "8 1 2 ..." copied
    together = propose_together(forks, token_ids, [5, 3])
    for drafter, ids, depth, proposal in zip(alone, token_ids, [5, 3], together, strict=True):
        torch.testing.assert_close(
            proposal.log_probs, drafter.propose(ids, depth).log_probs, rtol=0, atol=1e-12
        )
    assert together[0].log_probs.shape[0] == 5  # the copy runs past the inner drafter's block of 3


def test_a_copy_offer_expects_each_copied_token_kept_with_the_product_of_the_weights_before_it():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    context = [1, 2, 3, 4, 0, 1]
    assert boosted.copy_offer([1, 2, 3], 3) is None  # no earlier occurrence of the last token
    offer = boosted.copy_offer(context, 3)
    assert (offer.tokens, offer.ngram) == ([2, 3, 4], 1)
    assert offer.expected == pytest.approx([1.0, 1.5, 1.75, 1.875])  # w = 1/2 before any evidence
    assert boosted.copy_offer(context, 2).tokens == [2, 3]
    # taking two of its tokens verifies those only; the whole copy is scored by what the target
    # emits next ("2 3 5": depths 1-2 confirmed, depth 3 missed) when the next copy is taken
    assert boosted.take_copy(offer, 2, context).tokens.tolist() == [2, 3]
    context = [*context, 2, 3, 5, 1]
    boosted.take_copy(boosted.copy_offer(context, 3), 1, context)
    kept = np.cumprod([2 / 3, 2 / 3, 1 / 3])
    assert boosted.copy_offer(context, 3).expected == pytest.approx([1.0, *(1.0 + np.cumsum(kept))])


def test_an_offers_expectation_is_the_same_list_until_a_copy_is_scored():
    """A round plan reuses its answer for the very same expectation objects, asked every round."""
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    context = [1, 2, 3, 4, 0, 1]
    offer = boosted.copy_offer(context, 3)
    assert boosted.copy_offer(context, 3).expected is offer.expected
    assert boosted.copy_offer(context, 2).expected == offer.expected[:3]  # a shorter copy, its own list
    boosted.take_copy(offer, 2, context)
    later = [*context, 2, 3, 5, 1]
    boosted.take_copy(boosted.copy_offer(later, 3), 1, later)  # scores the first copy: depth 3 missed
    again = boosted.copy_offer(context, 3)
    assert again.expected is not offer.expected and again.expected != offer.expected


def test_the_copy_ceiling_bounds_every_offer_and_holds_until_a_copy_is_scored():
    boosted = LookupBoostedDrafter(FixedDrafter(LOG_PROBS))
    ceiling = boosted.copy_ceiling(3)
    assert ceiling == pytest.approx([1.0, 1.5, 1.75, 1.875])  # w = 1/2 everywhere before any evidence
    assert boosted.copy_ceiling(3) is ceiling  # asked every round: the same list while it holds
    context = [7, 8, 9, 1, 2, 3, 4, 7, 8, 9, 1, 2, 3, 0, 7, 8, 9]  # "7 8 9" repeats: a 3-gram match
    boosted.take_copy(boosted.copy_offer(context, 3), 3, context)
    context = [*context, 1, 2, 5, 7]  # depths 1-2 of the 3-gram copy confirmed, depth 3 missed
    boosted.take_copy(boosted.copy_offer(context, 3), 1, context)
    raised = boosted.copy_ceiling(3)
    assert raised is not ceiling and raised[1] > ceiling[1]  # the 3-gram's depth 1 now kept 2 in 3
    for end in range(2, len(context) + 1):
        offer = boosted.copy_offer(context[:end], 3)
        if offer is not None:
            assert all(e <= c + 1e-12 for e, c in zip(offer.expected, raised, strict=False))


class ConditionalDrafter(FixedDrafter):
    """Drafts from a table of rows per previous token, as DSpark and DFlash2 do."""

    TABLE = random_table(3, 8, seed=2)

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        return table_proposal(self.TABLE[:depth], int(token_ids[-1]))


@pytest.mark.parametrize("context, copied", [([7, 1, 2, 1], True), ([1, 2, 3], False)])
def test_a_copy_is_mixed_into_a_conditional_proposals_greedy_rows(context, copied):
    """Where lookup copies, the copy is mixed into the greedy chain's rows, which then are the
    proposal (its positions independent, as before conditionals); elsewhere its conditionals stay."""
    greedy = table_proposal(ConditionalDrafter.TABLE, context[-1]).log_probs
    proposal = LookupBoostedDrafter(ConditionalDrafter(greedy), weight=0.5).propose(torch.tensor(context), 3)
    expected = LookupBoostedDrafter(FixedDrafter(greedy), weight=0.5).propose(torch.tensor(context), 3)
    torch.testing.assert_close(proposal.log_probs, expected.log_probs, rtol=0, atol=0)
    assert (proposal.conditionals is None) == copied
