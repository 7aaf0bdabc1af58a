"""Verifiers must be exactly lossless: speculative output is distributed as plain target decoding.

The exactness tests drive whole rounds against a synthetic "true" target whose logits depend only
on (position, previous token), a tiny first-order model with an exactly computable joint
distribution, and chi-square-test the first two generated tokens against it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from diffdraft.decoding import verify
from diffdraft.decoding.verify import accept
from diffdraft.drafters.base import Proposal
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.trees import ChainBuilder, DDTreeBuilder, DraftTree, TreeBuilder, TreeRound, chain

from diffdraft_testing.conditionals import random_table, table_proposal

VOCAB = 5
DEPTH = 3
ROUNDS = 4000
ROOT = 2
SAMPLINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@st.composite
def trees(draw: st.DrawFn) -> DraftTree:
    """Random trees: parents precede children, siblings carry distinct tokens."""
    vocab = draw(st.integers(1, 4))
    tokens, parents, depths = [draw(st.integers(0, vocab - 1))], [-1], [0]
    used: list[set[int]] = [set()]
    for _ in range(draw(st.integers(0, 12))):
        open_nodes = [i for i, kids in enumerate(used) if len(kids) < vocab]
        parent = draw(st.sampled_from(open_nodes))
        token = draw(st.sampled_from(sorted(set(range(vocab)) - used[parent])))
        used[parent].add(token)
        used.append(set())
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_greedy_walk_takes_longest_argmax_path(tree: DraftTree, seed: int) -> None:
    vocab = int(tree.tokens.max()) + 1
    logits = torch.randn(tree.tokens.shape[0], vocab, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    # A node lies on the argmax path when its token is its parent's argmax and so is its parent.
    on_path = [True]
    for node in range(1, len(tokens)):
        on_path.append(on_path[parents[node]] and tokens[node] == best[parents[node]])
    expected = [node for node in range(len(tokens)) if on_path[node]]

    result = accept(tree, logits, SamplingParams(), None)
    assert result.path == expected
    assert result.next_token == best[expected[-1]]


def test_rows_must_match_nodes() -> None:
    with pytest.raises(ValueError, match="rows"):
        accept(DraftTree.root_only(0), torch.zeros(2, 4), SamplingParams(), None)


def test_rejection_sampling_needs_a_chain() -> None:
    fork = [torch.tensor(values) for values in ([0, 1, 2], [-1, 0, 0], [0, 1, 1])]
    tree = DraftTree(*fork, draft_probs=torch.full((3, 4), 0.25))
    with pytest.raises(ValueError, match="chain"):
        accept(tree, torch.zeros(3, 4), SamplingParams(temperature=1.0), None)


def test_identical_draft_is_always_accepted() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.9, top_k=4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        tree = ChainBuilder().build(
            TreeRound(ROOT, Proposal(log_probs=logits[:3].log_softmax(-1)), sampling, generator)
        )
        # The target's row i predicts the token after node i: make it the drafter's distribution.
        target = torch.cat([logits[:3], logits[3:]]).log_softmax(-1)
        assert accept(tree, target, sampling, generator).path == [0, 1, 2, 3]


def test_zero_residual_falls_back_to_target() -> None:
    p = torch.tensor([0.2, 0.8, 0.0])
    assert torch.equal(verify._residual(p, p.clone()), p)
    assert torch.allclose(verify._residual(p, torch.tensor([0.5, 0.5, 0.0])), torch.tensor([0.0, 1.0, 0.0]))


def true_target(seed: int) -> torch.Tensor:
    """logits[t, prev]: the target's logits for the token at position t + 1 after token ``prev``."""
    return 1.5 * torch.randn(DEPTH + 3, VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))


def exact_first_two(table: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[V, V] joint distribution of the first two generated tokens under plain sampling."""
    return sampling.probs(table[0, ROOT])[:, None] * sampling.probs(table[1])


def first_two_tokens(
    builder: TreeBuilder,
    table: torch.Tensor,
    sampling: SamplingParams,
    rounds: int,
    seed: int,
    conditional: bool = False,
) -> torch.Tensor:
    """[V, V] counts of the first two tokens emitted by speculative decoding, over ``rounds`` runs;
    ``conditional``: the drafter's distribution at each depth depends on the token drafted before it
    (DSpark's, DFlash2's), a fresh table of rows per previous token every round."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(rounds):
        out: list[int] = []
        root, start = ROOT, 0
        while len(out) < 2:
            # A deliberately poor drafter: fresh random marginals and depth every round, so rounds
            # end in rejections, in fully accepted drafts and in bonus tokens at every depth.
            depth = int(torch.randint(1, DEPTH + 1, (), generator=generator))
            if conditional:
                draft = table_proposal(
                    random_table(depth, VOCAB, int(torch.randint(2**31, (), generator=generator))), root
                )
            else:
                draft = Proposal(
                    log_probs=(2 * torch.randn(depth, VOCAB, generator=generator)).log_softmax(-1)
                )
            tree = builder.build(TreeRound(root, draft, sampling, generator))
            target_logits = table[start + tree.depths, tree.tokens]
            result = accept(tree, target_logits, sampling, generator)
            emitted = [*tree.tokens[result.path[1:]].tolist(), result.next_token]
            out += emitted
            root, start = result.next_token, start + len(emitted)
        counts[out[0], out[1]] += 1
    return counts


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of ``counts`` under ``expected``; impossible outcomes must never be observed."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    support = expected > 0
    assert counts[~support].sum() == 0, "an outcome the target can never produce was emitted"
    expected = expected[support] / expected[support].sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def assert_matches_target(counts: torch.Tensor, table: torch.Tensor, sampling: SamplingParams) -> None:
    joint = exact_first_two(table, sampling)
    assert chi_square_p(counts.sum(1), joint.sum(1)) > 1e-3
    assert chi_square_p(counts, joint) > 1e-3


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_sampling_walk_on_ddtree_is_exact(sampling: SamplingParams) -> None:
    table = true_target(seed=10)
    counts = first_two_tokens(DDTreeBuilder(6), table, sampling, ROUNDS, seed=11)
    assert_matches_target(counts, table, sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_rejection_sampling_on_sampled_chain_is_exact(sampling: SamplingParams) -> None:
    table = true_target(seed=20)
    counts = first_two_tokens(ChainBuilder(), table, sampling, ROUNDS, seed=21)
    assert_matches_target(counts, table, sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=repr)
def test_rejection_sampling_on_a_chain_sampled_from_conditionals_is_exact(sampling: SamplingParams) -> None:
    table = true_target(seed=30)
    counts = first_two_tokens(ChainBuilder(), table, sampling, ROUNDS, seed=31, conditional=True)
    assert_matches_target(counts, table, sampling)


def test_sampling_walk_on_a_ddtree_over_conditionals_is_exact() -> None:
    table = true_target(seed=40)
    counts = first_two_tokens(DDTreeBuilder(6), table, SAMPLINGS[1], ROUNDS, seed=41, conditional=True)
    assert_matches_target(counts, table, SAMPLINGS[1])


def test_chi_square_detects_a_chain_verified_against_rows_its_tokens_were_not_drawn_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tokens drawn after the token drawn before them, but tested against the greedy chain's rows (the
    rows a proposal hands out as its marginals): the output leaves the target's distribution."""
    walk = chain._sampled_walk

    def mismatched(root, proposal, sampling, generator):
        tokens, _ = walk(root, proposal, sampling, generator)
        return tokens, sampling.probs(proposal.log_probs)

    monkeypatch.setattr(chain, "_sampled_walk", mismatched)
    sampling = SAMPLINGS[0]
    table = true_target(seed=30)
    counts = first_two_tokens(ChainBuilder(), table, sampling, ROUNDS, seed=31, conditional=True)
    joint = exact_first_two(table, sampling)
    assert min(chi_square_p(counts.sum(1), joint.sum(1)), chi_square_p(counts, joint)) < 1e-3


def test_chi_square_detects_a_biased_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p instead of the residual after a rejection (a classic bug) must be caught."""
    monkeypatch.setattr(verify, "_residual", lambda p, q: p)
    sampling = SAMPLINGS[0]
    table = true_target(seed=20)
    counts = first_two_tokens(ChainBuilder(), table, sampling, ROUNDS, seed=21)
    joint = exact_first_two(table, sampling)
    assert chi_square_p(counts.sum(1), joint.sum(1)) < 1e-3
