import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffdraft.drafters.base import Proposal
from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.trees import TreeBuilder, TreeRound
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings
from diffdraft.trees.tree import MAX_TREE_NODES

from diffdraft_testing.ngram import PerContextLookups
from diffdraft_testing.trees import prefixes

GREEDY = SamplingParams()


class TableNgram(PerContextLookups):
    """An N-gram stand-in: log Pr(token | last order-1 tokens) from a random table."""

    def __init__(self, order: int, vocab: int, seed: int) -> None:
        self.order = order
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.table: dict[tuple[int, ...], np.ndarray] = {}

    def log_probs(self, context, tokens) -> np.ndarray:
        key = tuple(context[len(context) - (self.order - 1) :]) if self.order > 1 else ()
        if key not in self.table:
            self.table[key] = np.log(self.rng.dirichlet(np.full(self.vocab, 0.3)) + 1e-30)
        return self.table[key][np.asarray(tokens)].astype(np.float32)


def reference_tree(log_probs: torch.Tensor, history: list[int], ngram, s: DartTreeSettings) -> list[tuple]:
    """Algorithm 1 written out plainly: (path, score) of the kept nodes."""
    top_values, top_tokens = Proposal(log_probs=log_probs).top(s.top_k)  # the builder's pick among ties
    beam = [((), 0.0)]
    found = []
    for level in range(log_probs.shape[0]):
        extended = []
        for seq, score in beam:
            for value, token in zip(top_values[level].tolist(), top_tokens[level].tolist(), strict=True):
                draft = min(0.0, math.log(math.exp(value) + s.eps))
                term = s.logit_decay**level * draft
                if ngram is not None:
                    context = history + list(seq)
                    p = math.exp(float(ngram.log_probs(context, [token])[0]))
                    term += s.ngram_weight * min(0.0, math.log(p + s.eps))
                extended.append(((*seq, token), score + (level + 1) ** s.level_exponent * term))
        found.extend(extended)
        beam = sorted(extended, key=lambda item: -item[1])[: s.beam_width]
    return sorted(found, key=lambda item: -item[1])[: s.tree_size]


@st.composite
def cases(draw: st.DrawFn):
    vocab = draw(st.integers(2, 9))
    depth = draw(st.integers(1, 5))
    logits = draw(st.lists(st.integers(-4, 4), min_size=vocab * depth, max_size=vocab * depth))
    log_probs = torch.tensor(logits, dtype=torch.float32).view(depth, vocab).log_softmax(-1)
    settings_ = DartTreeSettings(
        tree_size=draw(st.integers(1, 30)), top_k=draw(st.integers(1, 6)), beam_width=draw(st.integers(1, 5))
    )
    order = draw(st.sampled_from([0, 1, 2, 3]))  # 0: no N-gram term
    return log_probs, settings_, order, draw(st.integers(0, 10_000))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_dart_tree_keeps_algorithm_1s_best_nodes(case) -> None:
    log_probs, s, order, seed = case
    vocab = log_probs.shape[1]
    ngram = TableNgram(order, vocab, seed) if order else None
    history = [seed % vocab, (seed // 7) % vocab]
    tree = DartTreeBuilder(s, ngram).build(
        TreeRound(history[-1], Proposal(log_probs=log_probs, prefix=torch.tensor(history)), GREEDY, None)
    )

    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0
    assert all(0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, len(parents)))
    paths = prefixes(tree)
    assert len(set(paths)) == len(paths), "every node is a distinct continuation"
    expected = reference_tree(log_probs, history, ngram, s)
    assert len(paths) == len(expected)
    # ties may pick different nodes of equal score; the kept scores must be the best ones
    scores = {path: score for path, score in expected}
    reference_all = {
        p: sc
        for p, sc in reference_tree(
            log_probs,
            history,
            ngram,
            DartTreeSettings(tree_size=MAX_TREE_NODES, top_k=s.top_k, beam_width=s.beam_width),
        )
    }
    got = sorted((reference_all[p] for p in paths), reverse=True)
    assert got == pytest.approx(sorted(scores.values(), reverse=True), abs=1e-4)


def test_ngram_term_changes_the_tree() -> None:
    """The drafter slightly prefers token 0; the N-gram says only token 3 continues the text."""

    class Likes3(PerContextLookups):
        order = 2

        def log_probs(self, context, tokens):
            return np.where(np.asarray(tokens) == 3, 0.0, math.log(1e-4)).astype(np.float32)

    log_probs = torch.tensor([[0.0, -0.1, -9.0, -0.1], [0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    s = DartTreeSettings(tree_size=1, top_k=4, beam_width=2)
    plain = DartTreeBuilder(s).build(TreeRound(0, Proposal(log_probs=log_probs), GREEDY, None))
    guided = DartTreeBuilder(s, Likes3()).build(TreeRound(0, Proposal(log_probs=log_probs), GREEDY, None))
    assert plain.tokens.tolist() == [0, 0]
    assert guided.tokens.tolist() == [0, 3]


def test_dart_builder_fits_the_interface_and_edge_cases() -> None:
    builder = DartTreeBuilder()
    assert isinstance(builder, TreeBuilder)
    assert builder.build(TreeRound(5, Proposal(), GREEDY, None)).num_nodes == 0
    assert builder.build(TreeRound(5, Proposal(log_probs=torch.zeros(0, 8)), GREEDY, None)).num_nodes == 0
    with pytest.raises(InvalidRequestError, match="distributions"):
        builder.build(TreeRound(5, Proposal(tokens=torch.tensor([1, 2])), GREEDY, None))
    with pytest.raises(InvalidRequestError, match="beam_width"):
        DartTreeSettings(beam_width=0)


def test_paper_defaults_give_a_59_node_tree() -> None:
    torch.manual_seed(0)
    log_probs = torch.randn(8, 500).mul(3).log_softmax(-1)
    tree = DartTreeBuilder().build(TreeRound(1, Proposal(log_probs=log_probs), GREEDY, None))
    assert tree.num_nodes == 59
    assert int(tree.depths.max()) >= 2


def test_a_tree_size_above_the_tree_bound_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match=f"tree_size must be at most {MAX_TREE_NODES} nodes"):
        DartTreeSettings(tree_size=10**9)
    assert DartTreeSettings(tree_size=MAX_TREE_NODES).tree_size == MAX_TREE_NODES
