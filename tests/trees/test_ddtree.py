import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffdraft.drafters.base import Proposal
from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.trees import DDTreeBuilder, TreeBuilder, TreeRound
from diffdraft.trees.tree import MAX_TREE_NODES

from diffdraft_testing.trees import prefixes

GREEDY = SamplingParams()


def score(prefix: tuple[int, ...], log_probs: list[list[float]]) -> float:
    total = 0.0
    for pos, token in enumerate(prefix):
        total += log_probs[pos][token]
    return total


def all_prefix_scores(log_probs: list[list[float]]) -> dict[tuple[int, ...], float]:
    vocab = len(log_probs[0])
    return {
        prefix: score(prefix, log_probs)
        for depth in range(1, len(log_probs) + 1)
        for prefix in itertools.product(range(vocab), repeat=depth)
    }


@st.composite
def drafts(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """Log-probs from small integer logits, so equal scores (ties) are common."""
    vocab = draw(st.integers(1, 5))
    depth = draw(st.integers(1, 4))
    logits = draw(st.lists(st.integers(-3, 3), min_size=vocab * depth, max_size=vocab * depth))
    log_probs = torch.tensor(logits, dtype=torch.float32).view(depth, vocab).log_softmax(-1)
    return log_probs, draw(st.integers(1, 14))


@settings(max_examples=200, deadline=None)
@given(drafts())
def test_ddtree_is_the_top_budget_prefixes(draft: tuple[torch.Tensor, int]) -> None:
    log_probs, budget = draft
    tree = DDTreeBuilder(budget).build(TreeRound(7, Proposal(log_probs=log_probs), GREEDY, None))
    table = log_probs.tolist()
    brute = all_prefix_scores(table)
    nodes = prefixes(tree)

    assert tree.tokens[0].item() == 7
    assert tree.num_nodes == min(budget, len(brute))
    assert len(set(nodes)) == len(nodes)
    assert all(p < i for i, p in enumerate(tree.parents.tolist()) if i > 0)
    assert tree.depths.tolist() == [0] + [len(p) for p in nodes]
    node_set = set(nodes)
    assert all(p[:-1] in node_set for p in nodes if len(p) > 1), "not prefix-closed"

    ranked = sorted(brute.values(), reverse=True)
    cut = tree.num_nodes
    assert sorted((score(p, table) for p in nodes), reverse=True) == ranked[:cut]
    if cut == len(ranked) or ranked[cut - 1] > ranked[cut]:  # no tie at the boundary: the set is unique
        assert node_set == {p for p, s in brute.items() if s >= ranked[cut - 1]}

    for node, kids in enumerate(tree.children()):
        kid_scores = [table[tree.depths[node].item()][tree.tokens[kid].item()] for kid in kids]
        assert kid_scores == sorted(kid_scores, reverse=True), "siblings not most probable first"


@settings(max_examples=100, deadline=None)
@given(drafts())
def test_ranked_gives_the_tree_and_each_nodes_prefix_score_in_order(draft: tuple[torch.Tensor, int]) -> None:
    log_probs, budget = draft
    tree_round = TreeRound(7, Proposal(log_probs=log_probs), GREEDY, None)
    tree, scores = DDTreeBuilder(budget).ranked(tree_round)
    built = DDTreeBuilder(budget).build(tree_round)
    assert torch.equal(tree.tokens, built.tokens) and torch.equal(tree.parents, built.parents)
    table = log_probs.tolist()
    assert scores[0] == 0.0
    assert scores[1:] == pytest.approx([score(p, table) for p in prefixes(tree)], abs=1e-5)
    assert scores[1:] == sorted(scores[1:], reverse=True)


@settings(max_examples=100, deadline=None)
@given(drafts(), st.integers(0, 100))
def test_mask_and_positions_match_parent_walk(draft: tuple[torch.Tensor, int], start: int) -> None:
    log_probs, budget = draft
    tree = DDTreeBuilder(budget).build(TreeRound(0, Proposal(log_probs=log_probs), GREEDY, None))
    parents = tree.parents.tolist()
    n = len(parents)
    expected_mask = torch.zeros(n, n, dtype=torch.bool)
    expected_pos = []
    for node in range(n):
        steps, cur = 0, node
        expected_mask[node, cur] = True
        while parents[cur] >= 0:
            cur = parents[cur]
            expected_mask[node, cur] = True
            steps += 1
        expected_pos.append(start + steps)
    assert torch.equal(tree.ancestor_mask(), expected_mask)
    assert tree.position_ids(start).tolist() == expected_pos


def test_ddtree_ignores_sampling_warp() -> None:
    log_probs = torch.randn(3, 6, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    builder = DDTreeBuilder(10)
    greedy = builder.build(TreeRound(1, Proposal(log_probs=log_probs), GREEDY, None))
    warped = builder.build(
        TreeRound(1, Proposal(log_probs=log_probs), SamplingParams(temperature=0.3, top_k=1), None)
    )
    assert torch.equal(greedy.tokens, warped.tokens)
    assert torch.equal(greedy.parents, warped.parents)


def test_zero_probability_candidates_are_skipped() -> None:
    one_hot = torch.full((4, 6), -math.inf)
    one_hot[torch.arange(4), torch.tensor([3, 1, 4, 1])] = 0.0
    tree = DDTreeBuilder(32).build(TreeRound(9, Proposal(log_probs=one_hot), GREEDY, None))
    assert tree.is_chain
    assert tree.tokens.tolist() == [9, 3, 1, 4, 1]


def test_depth_zero_and_budget_one() -> None:
    empty = DDTreeBuilder(8).build(TreeRound(5, Proposal(log_probs=torch.zeros(0, 4)), GREEDY, None))
    assert empty.tokens.tolist() == [5]
    assert DDTreeBuilder(8).build(TreeRound(5, Proposal(), GREEDY, None)).tokens.tolist() == [5]
    log_probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]]).log()
    single = DDTreeBuilder(1).build(TreeRound(5, Proposal(log_probs=log_probs), GREEDY, None))
    assert single.tokens.tolist() == [5, 1]


@pytest.mark.parametrize("budget", [0, -3, 2.5, "8", True, None])
def test_bad_budget_names_value_and_fix(budget: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"integer >= 1.*got") as info:
        DDTreeBuilder(budget)  # type: ignore[arg-type]
    assert repr(budget) in str(info.value)
    assert "--budget" in str(info.value)


def test_explicit_tokens_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="--method chain"):
        DDTreeBuilder(4).build(TreeRound(0, Proposal(tokens=torch.tensor([1, 2])), GREEDY, None))


def test_is_a_tree_builder() -> None:
    assert isinstance(DDTreeBuilder(4), TreeBuilder)


@settings(max_examples=100, deadline=None)
@given(drafts(), st.integers(0, 2**16))
def test_a_draft_vocabulary_proposal_builds_the_tree_of_its_full_rows(draft, seed) -> None:
    """A drafter that scores a few tokens hands over only their columns; the tree ranks those, and is
    the best tree of the full rows (every other token at probability 0)."""
    scored, budget = draft
    vocab_size = scored.shape[1] + 3
    vocab = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[: scored.shape[1]]
    restricted = Proposal.restricted(scored, vocab, vocab_size)
    tree = DDTreeBuilder(budget).build(TreeRound(7, restricted, GREEDY, None))
    full = restricted.log_probs
    assert full.shape == (scored.shape[0], vocab_size)
    assert torch.equal(full[:, vocab], scored) and full.isinf().sum() == 3 * scored.shape[0]
    expected = DDTreeBuilder(budget).build(TreeRound(7, Proposal(log_probs=full), GREEDY, None))
    table = full.tolist()
    assert tree.num_nodes == expected.num_nodes
    assert sorted(score(p, table) for p in prefixes(tree)) == sorted(
        score(p, table) for p in prefixes(expected)
    )
    assert set(tree.tokens[1:].tolist()) <= set(vocab.tolist())


def test_a_proposal_restricted_to_no_draft_vocabulary_is_its_full_rows() -> None:
    """Without a draft vocabulary the scored rows are the whole vocabulary's, handed over as they are."""
    scored = torch.randn(3, 6).log_softmax(-1)
    proposal = Proposal.restricted(scored, None, 6)
    assert proposal.log_probs is scored
    values, tokens = proposal.top(2)
    assert torch.equal(tokens, scored.topk(2, dim=-1).indices) and torch.equal(values, scored.topk(2).values)


def test_a_budget_above_the_tree_bound_is_refused_before_any_tree_is_built() -> None:
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_TREE_NODES} nodes.*got 1000000000"):
        DDTreeBuilder(10**9)
    assert DDTreeBuilder(MAX_TREE_NODES).budget == MAX_TREE_NODES
