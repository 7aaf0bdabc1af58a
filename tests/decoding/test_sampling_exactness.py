"""Sampling is exact: speculative decoding draws from the same distribution as plain sampling.

On an 8-token vocabulary the exact distribution of generated tokens 2 and 3 (the ones a
verification round decides) is computed by enumeration and compared with a chi-square test.
Seeds are fixed, so the test is deterministic; it fails only on a real bias.

The draws are decoded in continuous batches (:func:`sampled_pair_counts`): each sequence keeps its own
cache, drafter context and random stream, so its tokens are the ones its seed gives alone, and the
many draws cost a fraction of decoding them one after another. The single-sequence loop most users run
is held to the same draws seed for seed.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.drafters.dart import DARTDrafter
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.deer_model import DEERDraftModel, deer_from_causal_lm
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

from diffdraft_testing.batching import alone, batched
from diffdraft_testing.drafters import tiny_dart, tiny_dflash2, tiny_drafter, tiny_dspark
from diffdraft_testing.targets import ignore_windows, tiny_target, windowed_target

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]
RUNS = 1500
"""Draws per chi-square test, seeds 0 to RUNS - 1."""
BATCH = 64
"""Draws decoded at once (the quickest batch on 2 CPU cores: larger ones pay more per sequence)."""
ALONE = 100
"""Seeds also decoded alone, each of which must give the batch's tokens: a single-sequence path that
changed even 5% of the draws fails this with probability 1 - 0.95^100 > 99%, at any change in the
distribution or none."""
HOLES = [1, 4, 7]
"""Tokens the holed DEER drafter gives no probability."""


def exact_pair_distribution(model, sampling: SamplingParams) -> torch.Tensor:
    """P(token 2, token 3) with token 1 marginalized, by enumerating every prefix."""

    def next_probs(prefix):
        return sampling.probs(model(torch.tensor([prefix])).logits[0, -1]).double()

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        p1 = next_probs(PROMPT)
        for t1 in range(VOCAB):
            if p1[t1] == 0:
                continue
            p2 = next_probs([*PROMPT, t1])
            for t2 in range(VOCAB):
                if p2[t2] > 0:
                    joint[t2] += p1[t1] * p2[t2] * next_probs([*PROMPT, t1, t2])
    return joint.flatten()


def sampled_pair_counts(model, drafter, builder, sampling: SamplingParams) -> torch.Tensor:
    """How often each pair (token 2, token 3) came out of :data:`RUNS` seeded decodes of :data:`PROMPT`.

    The engine decodes them :data:`BATCH` at a time (:class:`~diffdraft.decoding.batching.BatchEngine`:
    its own cache, drafter fork and random stream each, and the target's float64 forward packed), which
    gives every seed the tokens it gets alone (tests/decoding/test_batching.py); the first
    :data:`ALONE` seeds are decoded alone too, through :meth:`SpeculativeEngine.run`, and must agree
    token for token. So the counts are the ones this test got decoding every seed alone (same seeds,
    same draws, same chi-square), sooner: a batch shares its rounds' forwards and their Python, and
    only the prefills stay one per sequence."""
    engine = SpeculativeEngine(TargetModel(model), drafter, builder)
    requests = [(PROMPT, 3, seed) for seed in range(RUNS)]
    outputs = batched(engine, requests, sampling, BATCH, eos=-1)
    for request, output in zip(requests[:ALONE], outputs, strict=False):
        assert alone(engine, request, sampling, eos=-1) == output, f"seed {request[2]}: alone != batched"
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for out in outputs:
        counts[out[1] * VOCAB + out[2]] += 1
    return counts


def assert_same_distribution(counts: torch.Tensor, probs: torch.Tensor) -> None:
    expected = probs / probs.sum() * counts.sum()  # float32 warping leaves ~1e-7 of slack
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    result = chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, f"sampled distribution differs from the target's (p={result.pvalue:.2e})"


def deer_drafter(model, holes: list[int] = ()) -> DEERDraftModel:
    """DEER cut from the target's first 2 of 4 layers (q near p, not equal), its head giving ``holes``
    a logit of about -1e4 at every position: hidden dimension 0 is made a positive constant (1 in
    every embedding, written to by no layer) and the holes' head rows read only it, negated."""
    deer = deer_from_causal_lm(model, 2, 3, VOCAB - 2, None, "the exactness test's target")
    if holes:
        with torch.no_grad():
            deer.model.embed_tokens.weight[:, 0] = 1.0
            for layer in deer.model.layers:
                layer.self_attn.o_proj.weight[0] = 0.0
                layer.mlp.down_proj.weight[0] = 0.0
            deer.model.norm.weight[0] = 1.0
            deer.lm_head.weight[holes] = 0.0
            deer.lm_head.weight[holes, 0] = -1e4
    return deer


def methods(model):
    target = TargetModel(model)
    drafter = DFlashDrafter(tiny_drafter(model, seed=1, block_size=3), target)
    # a drafter that can never propose three of the eight tokens: the residual must supply them
    restricted = DFlashDrafter(tiny_drafter(model, seed=1, block_size=3, draft_vocab=[0, 2, 3, 5, 6]), target)
    return {
        "rejection-chain": (drafter, ChainBuilder()),
        "rejection-chain-draft-vocab": (restricted, ChainBuilder()),
        "rejection-chain-lookup-boost": (LookupBoostedDrafter(drafter), ChainBuilder()),
        "walk-ddtree": (drafter, DDTreeBuilder(6)),
        "walk-pld-chain": (PromptLookupDrafter(max_depth=2), ChainBuilder()),
        # DART's drafter and beam tree, its head restricted to five tokens (holes in q's support)
        "walk-dart-tree": (
            DARTDrafter(tiny_dart(model, seed=1, draft_length=1, draft_vocab=[0, 2, 3, 5, 6]), target),
            DartTreeBuilder(DartTreeSettings(tree_size=6, top_k=3, beam_width=2)),
        ),
        # DEER's decoding (generator method deer): its chain, rejection sampled (DEER Eq. 5-6)
        "rejection-deer-chain": (DEERDrafter(deer_drafter(model), target), ChainBuilder()),
        # q with holes where p has mass: only the residual max(0, p - q) can emit those tokens
        "rejection-deer-chain-holes": (DEERDrafter(deer_drafter(model, HOLES), target), ChainBuilder()),
        # method deer-tree: DDTree over DEER's distributions, holes never in the tree
        "walk-deer-tree-holes": (DEERDrafter(deer_drafter(model, HOLES), target), DDTreeBuilder(6)),
    }


@pytest.mark.parametrize(
    "method",
    [
        "rejection-chain",
        "rejection-chain-draft-vocab",
        "rejection-chain-lookup-boost",
        "walk-ddtree",
        "walk-pld-chain",
        "walk-dart-tree",
        "rejection-deer-chain",
        "rejection-deer-chain-holes",
        "walk-deer-tree-holes",
    ],
)
@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
)
def test_speculative_sampling_matches_plain_sampling(method, sampling):
    model = tiny_target("qwen3", seed=5, vocab=VOCAB, init_std=0.05)
    drafter, builder = methods(model)[method]
    counts = sampled_pair_counts(model, drafter, builder, sampling)
    assert_same_distribution(counts, exact_pair_distribution(model, sampling))


def conditional_methods(model):
    """DSpark and DFlash2 drafters, whose distribution at a position depends on the token drafted
    before it: a sampled chain draws each token after the one drawn before it, and DDTree ranks each
    node's successors by its own row. Their rank-r terms drawn large, so that the dependence weighs."""
    target = TargetModel(model)
    dspark = tiny_dspark(model, seed=1, block_size=3, draft_vocab=[0, 2, 3, 5, 6])
    dspark.draft_top_k = 3
    dflash2 = tiny_dflash2(model, seed=1, block_size=3, selector_top_k=4)
    with torch.no_grad():
        dspark.markov_head.markov_w2.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(1))
    return {
        "rejection-chain-dspark": (DFlashDrafter(dspark, target), ChainBuilder()),
        "walk-ddtree-dspark": (DFlashDrafter(dspark, target), DDTreeBuilder(6)),
        "rejection-chain-dflash2": (DFlashDrafter(dflash2, target), ChainBuilder()),
    }


@pytest.mark.parametrize(
    "method", ["rejection-chain-dspark", "walk-ddtree-dspark", "rejection-chain-dflash2"]
)
def test_sampling_with_conditional_drafters_matches_plain_sampling(method):
    model = tiny_target("qwen3", seed=5, vocab=VOCAB, init_std=0.05)
    drafter, builder = conditional_methods(model)[method]
    sampling = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    counts = sampled_pair_counts(model, drafter, builder, sampling)
    assert_same_distribution(counts, exact_pair_distribution(model, sampling))


def windowed_model():
    """A window of 3 keys: tokens 2 and 3 (positions 6 and 7) no longer see the prompt's start; the
    init std makes that change the pair distribution well beyond the test's noise."""
    return windowed_target("gemma3", 3, seed=5, vocab=VOCAB, init_std=0.2)


@pytest.mark.parametrize("method", ["rejection-chain", "walk-ddtree", "walk-pld-chain", "walk-dart-tree"])
def test_speculative_sampling_under_a_sliding_window_matches_plain_sampling(method):
    model = windowed_model()
    drafter, builder = methods(model)[method]
    sampling = SamplingParams(temperature=1.0)
    counts = sampled_pair_counts(model, drafter, builder, sampling)
    assert_same_distribution(counts, exact_pair_distribution(model, sampling))


def test_the_check_catches_a_verifier_that_ignores_the_window(monkeypatch):
    model = windowed_model()
    exact = exact_pair_distribution(model, SamplingParams(temperature=1.0))  # transformers' own, windowed
    ignore_windows(monkeypatch)
    drafter, builder = methods(model)["walk-ddtree"]
    sampling = SamplingParams(temperature=1.0)
    counts = sampled_pair_counts(model, drafter, builder, sampling)
    with pytest.raises(AssertionError, match="differs from the target's"):
        assert_same_distribution(counts, exact)


def test_the_holed_deer_drafter_has_no_mass_where_the_target_has_some():
    model = tiny_target("qwen3", seed=5, vocab=VOCAB, init_std=0.05)
    drafter = DEERDrafter(deer_drafter(model, HOLES), TargetModel(model))
    q = drafter.propose(torch.tensor(PROMPT), 3).log_probs.exp()
    with torch.no_grad():
        p = model(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    assert q[:, HOLES].max() < 1e-12
    assert p[HOLES].min() > 0.05  # the target does emit them: the residual must supply them
    assert q[:, [0, 2, 3, 5, 6]].min() > 1e-3  # every other token can still be drafted


def test_the_check_catches_a_verifier_that_accepts_every_draft(monkeypatch):
    import diffdraft.decoding.engine
    from diffdraft.decoding.verify import Acceptance

    def accept_everything(tree, logits, sampling, generator):
        path = list(range(tree.tokens.shape[0]))
        return Acceptance(path, int(torch.multinomial(sampling.probs(logits[-1]), 1, generator=generator)))

    monkeypatch.setattr(diffdraft.decoding.engine, "accept", accept_everything)
    model = tiny_target("qwen3", seed=5, vocab=VOCAB, init_std=0.05)
    drafter, builder = methods(model)["rejection-chain"]
    sampling = SamplingParams(temperature=1.0)
    counts = sampled_pair_counts(model, drafter, builder, sampling)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_distribution(counts, exact_pair_distribution(model, sampling))


def test_exact_distribution_enumeration_is_normalized():
    model = tiny_target("qwen3", seed=5, vocab=VOCAB, init_std=0.05)
    total = exact_pair_distribution(model, SamplingParams(temperature=0.7, top_k=5)).sum()
    assert abs(float(total) - 1.0) < 1e-6
