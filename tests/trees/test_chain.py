import torch

from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.trees import ChainBuilder, TreeBuilder, TreeRound

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
