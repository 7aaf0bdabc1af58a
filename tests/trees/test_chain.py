import torch
from scipy.stats import chisquare

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.trees import ChainBuilder, TreeBuilder, TreeRound

from diffdraft_testing.conditionals import random_table, table_proposal

GREEDY = SamplingParams()
WARM = SamplingParams(temperature=0.8, top_k=4)


def random_log_probs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    return (2 * torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed))).log_softmax(-1)


def test_greedy_chain_is_argmax() -> None:
    log_probs = random_log_probs(5, 11, seed=0)
    tree = ChainBuilder().build(TreeRound(3, Proposal(log_probs=log_probs), GREEDY, None))
    assert tree.tokens.tolist() == [3, *log_probs.argmax(-1).tolist()]
    assert tree.is_chain
    assert tree.draft_probs is None


def test_explicit_tokens_are_kept() -> None:
    tree = ChainBuilder().build(TreeRound(3, Proposal(tokens=torch.tensor([8, 8, 2])), WARM, None))
    assert tree.tokens.tolist() == [3, 8, 8, 2]
    assert tree.draft_probs is None


def test_sampled_chain_records_warped_draft_probs() -> None:
    log_probs = random_log_probs(6, 9, seed=1)
    build = ChainBuilder().build
    tree = build(TreeRound(3, Proposal(log_probs=log_probs), WARM, torch.Generator().manual_seed(5)))
    q = WARM.probs(log_probs)
    assert tree.draft_probs is not None
    assert torch.equal(tree.draft_probs[1:], q)
    assert (q.gather(-1, tree.tokens[1:, None]) > 0).all(), "token drawn outside the warped support"
    again = build(TreeRound(3, Proposal(log_probs=log_probs), WARM, torch.Generator().manual_seed(5)))
    assert torch.equal(tree.tokens, again.tokens)


def test_sampled_chain_follows_draft_distribution() -> None:
    log_probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).log()
    generator = torch.Generator().manual_seed(2)
    hot = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(2000):
        tree = ChainBuilder().build(TreeRound(0, Proposal(log_probs=log_probs), hot, generator))
        counts[tree.tokens[1]] += 1
    assert counts[3] == 0
    assert torch.allclose(counts / 2000, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.04)


def test_depth_zero_is_root_only() -> None:
    for proposal in (Proposal(), Proposal(log_probs=torch.zeros(0, 5)), Proposal(tokens=torch.zeros(0))):
        tree = ChainBuilder().build(TreeRound(4, proposal, WARM, None))
        assert tree.tokens.tolist() == [4]
        assert tree.parents.tolist() == [-1]


def test_chain_mask_is_causal_and_positions_count_up() -> None:
    tree = ChainBuilder().build(
        TreeRound(1, Proposal(log_probs=random_log_probs(7, 5, seed=3)), GREEDY, None)
    )
    assert torch.equal(tree.ancestor_mask(), torch.ones(8, 8, dtype=torch.bool).tril())
    assert tree.position_ids(40).tolist() == list(range(40, 48))


def test_is_a_tree_builder() -> None:
    assert isinstance(ChainBuilder(), TreeBuilder)


def test_a_conditional_chain_draws_each_token_after_the_one_drawn_before_it() -> None:
    """The drafted pair follows the drafter's joint (chain rule), and the tree keeps, for each token,
    the warped row it was drawn from: the one after the token drawn before it."""
    table = random_table(2, 4, seed=4)
    generator = torch.Generator().manual_seed(6)
    hot = SamplingParams(temperature=1.0)
    counts = torch.zeros(4, 4)
    for _ in range(3000):
        tree = ChainBuilder().build(TreeRound(1, table_proposal(table, 1), hot, generator))
        first, second = tree.tokens[1:].tolist()
        assert torch.equal(tree.draft_probs[1], hot.probs(table[0, 1]))
        assert torch.equal(tree.draft_probs[2], hot.probs(table[1, first]))
        counts[first, second] += 1
    joint = (table[0, 1].exp()[:, None] * table[1].exp()).double().flatten()
    expected, observed = joint / joint.sum() * 3000, counts.flatten().double()
    big = expected >= 5  # the sparse cells pooled, so that the chi-square approximation holds
    observed = torch.cat([observed[big], observed[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_a_greedy_conditional_chain_is_the_argmax_walk() -> None:
    table = random_table(4, 9, seed=5)
    tree = ChainBuilder().build(TreeRound(2, table_proposal(table, 2), GREEDY, None))
    previous, walk = 2, []
    for position in range(4):
        previous = int(table[position, previous].argmax())
        walk.append(previous)
    assert tree.tokens.tolist() == [2, *walk] and tree.draft_probs is None
