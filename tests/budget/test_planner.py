"""The planner: the DDTree surrogate, what observed rounds teach (acceptance and the cost curve's scale)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffdraft.budget.cost import VerifyCostCurve
from diffdraft.budget.planner import (
    MIN_TIMED_ROUNDS,
    OWN_ROUNDS,
    PRIOR_ROUNDS,
    BudgetPlanner,
    ObservedRound,
    latest_drafted,
    rounds_of,
    surrogate_acceptance,
)
from diffdraft.drafters.base import Proposal, vocab_columns
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.trees import DDTreeBuilder, TreeRound

from diffdraft_testing.budget import verified


def test_the_surrogate_sums_the_best_prefix_probabilities():
    log_probs = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]).log()
    _, scores = DDTreeBuilder(9).ranked(TreeRound(0, Proposal(log_probs=log_probs), SamplingParams(), None))
    # prefixes by probability: a .6, then b .3 and aa .3, ab .24, ba .15, bb .12, c .1 ...
    expected = [1.0, 1.6, 1.9, 2.2, 2.44, 2.59]
    assert surrogate_acceptance(scores)[:6] == pytest.approx(expected)


def test_the_surrogate_of_a_restricted_proposal_reads_its_scored_columns_only():
    # the draft vocabulary (7, 2, 4) of 9 tokens, scored as the test above scores its (0, 1, 2)
    vocab = torch.tensor([7, 2, 4])
    scored = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]).log()
    proposal = Proposal.restricted(scored, vocab, 9, vocab_columns(vocab))
    _, scores = DDTreeBuilder(9).ranked(TreeRound(0, proposal, SamplingParams(), None))
    assert surrogate_acceptance(scores)[:6] == pytest.approx([1.0, 1.6, 1.9, 2.2, 2.44, 2.59])
    assert proposal._log_probs is None  # the [depth, 9] rows were never written out


def _rounds(count: int, budget: int, accepted: list[int], seconds: float = 0.0) -> list[ObservedRound]:
    return [ObservedRound(budget, accepted, context=512, seconds=seconds) for _ in range(count)]


def _linear_surrogate_planner(max_budget: int = 32) -> BudgetPlanner:
    """A planner over a flat cost curve whose drafter promises 0.1 accepted tokens per node."""
    planner = BudgetPlanner(
        VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.01]]), max_budget
    )
    planner.observe_proposal([1.0 + 0.1 * b for b in range(40)])
    return planner


def test_the_planner_measures_each_rank_from_the_rounds_that_verified_it():
    planner = _linear_surrogate_planner()
    assert planner.max_budget == 32
    assert planner.expected_tau()[10] == pytest.approx(2.0)  # the surrogate alone before any round
    # 32 rounds at budget 10: half accepted node 3, half nothing
    planner.observe_rounds(_rounds(16, 10, [3]) + _rounds(16, 10, []))
    tau = planner.expected_tau()
    # nodes 6..10 added nothing where the surrogate promised 0.1 each: its promise is worth nothing
    assert planner.growth_calibration() == pytest.approx(0.0)
    assert tau[2] == pytest.approx(1.0)
    assert tau[3] - tau[2] == pytest.approx(16 / (32 + PRIOR_ROUNDS))  # measured, weighed against 0
    assert tau[32] == tau[10] == tau[3]


def test_rounds_that_verified_no_tree_push_no_drafted_round_out_of_the_record():
    planner = _linear_surrogate_planner()
    planner.observe_rounds(_rounds(16, 10, [3]) + _rounds(16, 10, []))
    measured = planner.expected_tau()
    planner.observe_rounds(_rounds(300, 0, []))  # under load: plain rounds only
    assert planner.rank_gains()[1][2] == 32
    assert planner.expected_tau() == measured


def test_the_surrogate_covers_unmeasured_ranks_scaled_by_the_share_the_target_confirmed():
    planner = _linear_surrogate_planner()
    # accepted nodes 3 and 8, or 2: ranks 6..10 paid 0.5 of the 0.5 the surrogate promised
    planner.observe_rounds(_rounds(16, 10, [3, 8]) + _rounds(16, 10, [2]))
    assert planner.growth_calibration() == pytest.approx(1.0)
    tau = planner.expected_tau()
    assert tau[20] - tau[10] == pytest.approx(10 * 0.1)  # no round verified 11..20: the surrogate
    # a share above 1 (long copies inside the tree) is not stretched onto unmeasured ranks
    planner.observe_rounds(_rounds(64, 10, [3, 7, 8, 9]))
    assert planner.growth_calibration() == 1.0
    # rounds that verified 15 nodes measure ranks 11..15 and outweigh the promise as they add up
    planner.observe_rounds(_rounds(48, 15, [1, 12]))
    tau = planner.expected_tau()
    assert tau[12] - tau[11] == pytest.approx((48 + PRIOR_ROUNDS * 0.1) / (48 + PRIOR_ROUNDS))
    assert tau[13] - tau[12] == pytest.approx(PRIOR_ROUNDS * 0.1 / (48 + PRIOR_ROUNDS))


def test_a_running_sequence_is_planned_from_its_own_surrogates_and_rounds():
    planner = _linear_surrogate_planner()  # the finished sequences' drafter promised 0.1 per node
    sequence = GenerationStats(surrogates=[[1.0 + 0.3 * b for b in range(40)]])
    assert planner.expected_tau(sequence)[10] == pytest.approx(4.0)  # its own promise, not theirs
    assert planner.expected_tau()[10] == pytest.approx(2.0)
    # 16 of its own rounds at budget 10 accepted nodes 1 and 2 only: as heavy as the estimate before
    for _ in range(PRIOR_ROUNDS):
        verified(sequence, 10, [1, 2])
    gains = np.diff(planner.expected_tau(sequence))
    assert gains[:2] == pytest.approx([(PRIOR_ROUNDS + PRIOR_ROUNDS * 0.3) / (2 * PRIOR_ROUNDS)] * 2)
    assert gains[2:10] == pytest.approx([0.15] * 8)
    assert gains[10:] == pytest.approx([0.3] * 22)  # ranks its rounds never verified: its promise
    # finished rounds measured rank 3 at 1.0: the sequence's prior for it moves there first
    planner.observe_rounds(_rounds(3 * PRIOR_ROUNDS, 3, [1, 2, 3]))
    pooled = (3 * PRIOR_ROUNDS + PRIOR_ROUNDS * 0.3) / (4 * PRIOR_ROUNDS)
    assert np.diff(planner.expected_tau(sequence))[2] == pytest.approx(pooled / 2)


def test_a_running_sequence_reads_only_its_latest_drafted_rounds():
    planner = _linear_surrogate_planner()
    sequence = GenerationStats(surrogates=[[1.0 + 0.3 * b for b in range(40)]])
    for _ in range(OWN_ROUNDS):  # a stretch where the drafter's first guess was always wrong
        verified(sequence, 10, [])
    assert np.diff(planner.expected_tau(sequence))[0] == pytest.approx(
        0.3 * PRIOR_ROUNDS / (OWN_ROUNDS + PRIOR_ROUNDS)
    )
    for _ in range(OWN_ROUNDS):  # then one where it was always right: the wrong stretch is forgotten
        verified(sequence, 10, [1])
        verified(sequence, 0, [])  # rounds that drafted nothing neither count nor push rounds out
    assert np.diff(planner.expected_tau(sequence))[0] == pytest.approx(
        (OWN_ROUNDS + 0.3 * PRIOR_ROUNDS) / (OWN_ROUNDS + PRIOR_ROUNDS)
    )


def test_the_rounds_own_verification_times_rescale_the_cached_curve():
    sizes = [1, 8, 16, 64]
    curve = VerifyCostCurve(sizes=sizes, contexts=[512], seconds=[[0.02, 0.02, 0.03, 0.1]])
    planner = BudgetPlanner(curve, max_budget=32)
    planner.observe_proposal([1.0 + 0.1 * b for b in range(40)])
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS - 1, 15, [], seconds=0.06))
    assert planner.cost()(16, 512) == pytest.approx(0.03)  # too few rounds to trust yet
    planner.observe_rounds(_rounds(1, 15, [], seconds=0.06) + _rounds(8, 7, [], seconds=0.02))
    assert planner.cost_scales() == ([8, 16], [pytest.approx(1.0), pytest.approx(2.0)], [8, MIN_TIMED_ROUNDS])
    assert planner.cost()(16, 512) == pytest.approx(0.06)
    assert planner.cost()(12, 512) == pytest.approx(curve(12, 512) * 1.5)  # linear between sizes
    assert planner.cost()(32, 512) == pytest.approx(curve(32, 512) * 2.0)  # constant beyond
    # a line through the sizes' scales, weighted by rounds: one odd size does not bend the curve
    planner.observe_rounds(_rounds(4, 11, [], seconds=0.1 * curve(12, 512)))
    assert planner.cost()(12, 512) < curve(12, 512) * 1.5


def test_until_plain_rounds_are_timed_a_plain_round_costs_the_curves_own_point():
    """Drafting rounds run slower than the curve (their drafter pushes the target's weights out of a
    CPU's cache); carried down to a plain round, their scale kept a plan drafting for good."""
    curve = VerifyCostCurve(sizes=[1, 8, 16, 64], contexts=[512], seconds=[[0.02, 0.02, 0.03, 0.1]])
    planner = BudgetPlanner(curve, max_budget=32)
    planner.observe_proposal([1.0 + 0.1 * b for b in range(40)])
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS, 7, [], seconds=0.024))  # 1.2x the curve
    assert planner.cost()(1, 512) == pytest.approx(0.02)
    assert planner.cost()(2, 512) == pytest.approx(curve(2, 512) * 1.2)  # a copy's: as drafting's
    assert np.allclose(planner.cost()(np.arange(1, 3), 512), [0.02, curve(2, 512) * 1.2])
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS, 0, [], seconds=0.022))  # plain rounds, timed
    assert planner.cost()(1, 512) > 0.02


def test_timed_plain_rounds_outlive_a_long_stretch_of_drafted_ones():
    """Plain and tree rounds keep their own windows: once a run of sequences that drafted every round
    had pushed the plain ones out of a shared window, a plain round read the curve's own point while
    the trees read the machine's slower speed since, and plain decoding looked twice as cheap."""
    curve = VerifyCostCurve(sizes=[1, 8, 16, 64], contexts=[512], seconds=[[0.02, 0.02, 0.03, 0.1]])
    planner = BudgetPlanner(curve, max_budget=32, timed_rounds=16)
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS, 0, [], seconds=0.046))  # 2.3x the curve
    planner.observe_rounds(_rounds(64, 7, [], seconds=0.046))  # drafted, 2.3x as well
    assert planner.cost()(1, 512) == pytest.approx(0.046)
    assert planner.cost()(8, 512) == pytest.approx(0.046)


def test_tree_rounds_age_out_by_the_plain_rounds_timed_after_them():
    """Trees timed in a slow spell of the machine (2.45x the curve) made a lone sequence stop
    drafting; plain rounds then read the machine's speed again, but only the rare explorations timed
    new trees, so the spell's trees kept drafting dear for requests. Once as many plain rounds were
    timed after a tree as the window holds, the tree no longer counts (the trees then cost the
    curve's shape at the plain rounds' scale, until drafted rounds time them anew)."""
    curve = VerifyCostCurve(sizes=[1, 8, 16, 64], contexts=[512], seconds=[[0.02, 0.02, 0.03, 0.1]])
    planner = BudgetPlanner(curve, max_budget=32, timed_rounds=16)
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS, 7, [], seconds=0.049))  # 2.45x, in the spell
    planner.observe_rounds(_rounds(15, 0, [], seconds=0.02))  # plain, at the curve's speed
    assert planner.cost()(8, 512) == pytest.approx(0.049)
    planner.observe_rounds(_rounds(1, 0, [], seconds=0.02))  # the 16th plain round since
    assert planner.cost_scales()[0] == [1]
    assert planner.cost()(8, 512) == pytest.approx(0.02)
    planner.observe_rounds(_rounds(MIN_TIMED_ROUNDS, 7, [], seconds=0.03))  # drafted again: timed anew
    assert planner.cost()(8, 512) == pytest.approx(0.03)


def test_a_plain_round_is_timed_only_where_it_ran_steady_as_the_curve_times_one_token_rounds():
    """Not within eight rounds of the prompt or of a drafted round (their forwards run slow); a free
    copy's round is left out, and alone it does not count as drafting."""
    sizes = [0] * 10 + [3] + [0] * 10 + [2] + [0] * 2
    stats = GenerationStats(
        tree_sizes=sizes,
        accepted_nodes=[[] for _ in sizes],
        verify_contexts=[10 + i for i in range(len(sizes))],
        verify_seconds=[0.001 * (i + 1) for i in range(len(sizes))],
        verify_forwards=[(1, size + 1, 10 + i) for i, size in enumerate(sizes)],
        copy_rounds=[21],
    )
    timed = [(r.budget, r.seconds) for r in rounds_of(stats)]
    steady = {8, 9, 10, 19, 20, 22, 23}  # the drafted round 10 is timed as drafting rounds are
    expected = [(size, 0.001 * (i + 1) if i in steady else 0.0) for i, size in enumerate(sizes) if i != 21]
    assert [budget for budget, _ in timed] == [budget for budget, _ in expected]
    assert [seconds for _, seconds in timed] == pytest.approx([seconds for _, seconds in expected])


@pytest.mark.parametrize("seed", range(3))
def test_the_latest_drafted_rounds_are_the_tail_of_the_rounds_that_drafted(seed):
    rng = np.random.default_rng(seed)
    stats = GenerationStats()
    for index in range(90):
        kind = rng.choice(["drafted", "plain", "copy"])
        if kind == "copy":
            stats.copy_rounds.append(index)
        size = 0 if kind == "plain" else int(rng.integers(1, 9))
        stats.tree_sizes.append(size)
        stats.accepted_nodes.append(list(range(1, int(rng.integers(0, size + 1)) + 1)))
        stats.verify_contexts.append(100 + index)
        stats.verify_seconds.append(float(rng.random()))
        stats.verify_forwards.append((int(rng.integers(1, 4)), size + 1, 100 + index))
    drafted = [
        index for index, size in enumerate(stats.tree_sizes) if size > 0 and index not in stats.copy_rounds
    ]
    for count in (1, 5, 32, 200):
        assert latest_drafted(stats, count) == drafted[-count:]


def test_the_growth_calibration_weighs_rounds_against_what_was_promised_for_them():
    """Rounds and proposals are kept over different windows: a drafter that kept its promise on every
    text must not look overconfident because the latest rounds' texts were harder than the mean."""
    curve = VerifyCostCurve(sizes=[1, 64], contexts=[512], seconds=[[0.01, 0.01]])
    planner = BudgetPlanner(curve, max_budget=32, rounds=20)
    easy, hard = ([1.0 + gain * b for b in range(33)] for gain in (0.5, 0.1))
    planner.observe_proposal(easy)
    planner.observe_rounds(_rounds(20, 10, list(range(1, 11))), np.diff(easy))
    planner.observe_proposal(hard)
    # 2 of 20 rounds accept all 10 nodes: 0.1 per rank, as promised (the rounds window keeps these only)
    planner.observe_rounds(_rounds(2, 10, list(range(1, 11))) + _rounds(18, 10, []), np.diff(hard))
    assert planner.surrogate()[10] == pytest.approx(4.0)  # the proposals' mean promises 0.3 per node
    assert planner.growth_calibration() == pytest.approx(1.0)
    assert np.diff(planner.expected_tau())[20] == pytest.approx(0.3)  # unmeasured: the mean promise
