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
from diffdraft.trees.successors import SIBLINGS_AT_ONCE
from diffdraft.trees.tree import MAX_TREE_NODES

from diffdraft_testing.conditionals import joint_scores, random_table, table_proposal
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


@st.composite
def conditional_drafts(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """Conditional tables [depth, V, V] from small integer logits (ties are common), and a budget."""
    vocab = draw(st.integers(1, 4))
    depth = draw(st.integers(1, 4))
    size = depth * vocab * vocab
    logits = draw(st.lists(st.integers(-3, 3), min_size=size, max_size=size))
    table = torch.tensor(logits, dtype=torch.float32).view(depth, vocab, vocab).log_softmax(-1)
    return table, draw(st.integers(1, 14))


@settings(max_examples=200, deadline=None)
@given(conditional_drafts())
def test_a_conditional_ddtree_is_the_top_budget_prefixes_under_the_joint(draft) -> None:
    """Each node's children ranked by its own conditional row: the tree holds the B likeliest paths
    under the chain rule, and ``ranked`` gives each node's joint log-probability, in order."""
    table, budget = draft
    root = 0
    tree, scores = DDTreeBuilder(budget).ranked(TreeRound(root, table_proposal(table, root), GREEDY, None))
    vocab, depth = table.shape[1], table.shape[0]
    brute = {
        prefix: joint_scores(prefix, table, root)
        for length in range(1, depth + 1)
        for prefix in itertools.product(range(vocab), repeat=length)
    }
    nodes = prefixes(tree)
    assert tree.num_nodes == min(budget, len(brute)) and len(set(nodes)) == len(nodes)
    assert all(p[:-1] in set(nodes) for p in nodes if len(p) > 1), "not prefix-closed"
    assert scores[1:] == [brute[p] for p in nodes]
    assert scores[1:] == sorted(scores[1:], reverse=True)
    ranked = sorted(brute.values(), reverse=True)
    cut = tree.num_nodes
    assert sorted(scores[1:], reverse=True) == ranked[:cut]
    if cut == len(ranked) or ranked[cut - 1] > ranked[cut]:  # no tie at the boundary: the set is unique
        assert set(nodes) == {p for p, s in brute.items() if s >= ranked[cut - 1]}


def test_a_siblings_successors_are_its_own_not_the_greedy_chains() -> None:
    """After token 1 the drafter expects 1, after token 2 it expects 2: the greedy chain's rows (after
    the argmax, 1) would give 2 the successors of 1."""
    table = torch.full((2, 4, 4), 0.01).log()
    table[0, 0] = torch.tensor([0.0, 0.5, 0.4, 0.1]).log()
    table[1, 1] = torch.tensor([0.05, 0.9, 0.03, 0.02]).log()
    table[1, 2] = torch.tensor([0.05, 0.03, 0.9, 0.02]).log()
    table = table.log_softmax(-1)
    proposal = table_proposal(table, 0)
    tree = DDTreeBuilder(4).build(TreeRound(0, proposal, GREEDY, None))
    assert set(prefixes(tree)) == {(1,), (2,), (1, 1), (2, 2)}
    independent = Proposal(log_probs=proposal.log_probs)  # the greedy chain's rows, as before
    assert torch.equal(independent.log_probs[1], table[1, 1])
    old = DDTreeBuilder(4).build(TreeRound(0, independent, GREEDY, None))
    assert set(prefixes(old)) == {(1,), (2,), (1, 1), (2, 1)}


def test_a_conditional_tree_computes_only_the_rows_it_expands() -> None:
    """Rows are computed when the heap expands a node (and a few of its next siblings with it), the
    greedy chain's rows never."""
    table = random_table(6, 50, seed=3)
    proposal = table_proposal(table, 7)
    conditionals, asked = proposal.conditionals, []
    rows = conditionals.rows
    conditionals.rows = lambda position, previous: asked.append(len(previous)) or rows(position, previous)
    conditionals.greedy_rows = None  # calling it fails
    tree = DDTreeBuilder(12).build(TreeRound(7, proposal, GREEDY, None))
    assert tree.num_nodes == 12
    assert len(asked) <= 13 and sum(asked) <= 1 + SIBLINGS_AT_ONCE * 12
