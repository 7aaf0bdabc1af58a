"""The fused draft forward: the module forward's proposals up to rounding, on both variants, with and
without a draft vocabulary, through context appends that outgrow the buffers."""

from __future__ import annotations

import itertools

import pytest
import torch

from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear, Q8Weight
from diffdraft.target.model import TargetModel

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target

pytestmark = needs_block_kernel


def _drafters(
    variant: str, draft_vocab: list[int] | None, seed: int, q8_head: bool = False
) -> tuple[DFlashDrafter, DFlashDrafter]:
    """(fused, module-forward) drafters of the same weights beside a laid-out bf16 block target, its LM
    head on the int8 kernel where ``q8_head`` (as a GGUF target's)."""
    model, _ = q4_1_target("llama", seed=seed, vocab=96)
    fuse_projections(model)
    if q8_head:
        model.lm_head = BlockQuantizedLinear(Q8Weight.quantize(model.lm_head.weight))
    target = TargetModel(model)
    fused, eager = (
        DFlashDrafter(tiny_drafter(model, seed, 2, 6, variant, draft_vocab=draft_vocab), target) for _ in "ab"
    )
    eager._fused = None
    return fused, eager


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 96, 3))])
def test_fused_proposals_are_the_module_forwards(variant, draft_vocab):
    fused, eager = _drafters(variant, draft_vocab, seed=1)
    assert fused._fused is not None
    g = torch.Generator().manual_seed(2)
    hidden_size = fused.model.config.hidden_size
    taps = len(fused.target_layer_ids)
    committed = 0
    for new in (300, 3, 1, 40):  # the first append outgrows the initial rows
        states = torch.randn(new, taps, hidden_size, generator=g).to(torch.bfloat16)
        for drafter in (fused, eager):
            drafter.extend_context(states, committed)
        committed += new
        token_ids = torch.randint(0, 90, (committed + 1,), generator=g)
        proposals = [drafter.propose(token_ids, 5).log_probs for drafter in (fused, eager)]
        assert proposals[0].shape == (5, 96)
        probs = [p.exp() for p in proposals]
        torch.testing.assert_close(probs[0], probs[1], rtol=0, atol=0.02)
        assert torch.equal(proposals[0].isinf(), proposals[1].isinf())  # the same draft vocabulary
    assert fused._context.length == eager._context.length == committed
    block_layers = [m for m in fused.model.modules() if isinstance(m, BlockQuantizedLinear)]
    assert block_layers and not any(m._dense for m in block_layers)  # 300 rows stayed on the kernel


def test_forks_draft_from_contexts_of_their_own():
    fused, _ = _drafters(DFLARE, None, seed=3)
    fork = fused.fork()
    states = torch.randn(4, len(fused.target_layer_ids), fused.model.config.hidden_size).to(torch.bfloat16)
    fused.extend_context(states, 0)
    fused.propose(torch.arange(5), 5)
    assert fused._context.length == 4 and fork._context.length == 0


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 96, 3))])
def test_forks_drafted_together_get_what_each_drafts_alone(draft_vocab):
    from diffdraft.drafters.base import propose_together

    fused, _ = _drafters(DFLARE, draft_vocab, seed=4)
    g = torch.Generator().manual_seed(5)
    forks, token_ids = [], []
    for length in (7, 2, 300, 5):  # one context outgrows the initial rows
        fork = fused.fork()
        states = torch.randn(length, len(fused.target_layer_ids), fused.model.config.hidden_size, generator=g)
        fork.extend_context(states.to(torch.bfloat16), 0)
        forks.append(fork)
        token_ids.append(torch.randint(0, 90, (length + 1,), generator=g))
    depths = [5, 3, 1, 5]
    together = propose_together(forks, token_ids, depths)
    for fork, ids, depth, proposal in zip(forks, token_ids, depths, together, strict=True):
        alone = fork.propose(ids, depth)
        assert proposal.depth == depth
        torch.testing.assert_close(proposal.log_probs, alone.log_probs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
def test_a_blocks_layer_loop_in_one_op_gives_the_python_loops_bits(variant):
    """``draft_layers`` against :class:`FusedDraftLayers`' Python loop over the same ops, through context
    appends that outgrow the buffers: the same proposals, and the same block rows left in the buffers."""
    looped, python = _drafters(variant, None, seed=6)
    python._fused = type(looped._fused)(python.model)
    assert looped._fused.stack is not None
    python._fused.stack = None
    python._lm_head = None  # its rounds step by step
    g = torch.Generator().manual_seed(7)
    committed = 0
    for new in (300, 2, 1):
        states = torch.randn(new, len(looped.target_layer_ids), looped.model.config.hidden_size, generator=g)
        for drafter in (looped, python):
            drafter.extend_context(states.to(torch.bfloat16), committed)
        committed += new
        token_ids = torch.randint(0, 90, (committed + 1,), generator=g)
        proposals = [drafter.propose(token_ids, 4).log_probs for drafter in (looped, python)]
        assert torch.equal(proposals[0], proposals[1])
        buffers = [drafter._context.block_room(5) for drafter in (looped, python)]
        for a, b in zip(*(keys + values for keys, values in buffers), strict=True):
            assert torch.equal(a[:, :, : committed + 5], b[:, :, : committed + 5])


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
def test_the_context_projection_in_one_op_gives_the_python_steps_bits(variant):
    """``draft_context`` against :meth:`FusedDraftLayers.context_features` and ``context_kv`` then an
    append, through appends that outgrow the buffers: the same context rows, bit for bit."""
    in_op, python = _drafters(variant, None, seed=8)
    python._fused = type(in_op._fused)(python.model)
    assert in_op._fused.context_stack is not None
    python._fused.context_stack = None
    python._lm_head = None
    g = torch.Generator().manual_seed(9)
    committed = 0
    for new in (300, 2, 1, 57):  # the first fills a buffer of its own size, the second outgrows it
        states = torch.randn(new, len(in_op.target_layer_ids), in_op.model.config.hidden_size, generator=g)
        for drafter in (in_op, python):
            drafter.extend_context(states.to(torch.bfloat16), committed)
            drafter._projected_context()
        committed += new
        assert in_op._context.length == python._context.length == committed
        for a, b in zip(in_op._context.layers(), python._context.layers(), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 96, 3))])
def test_a_drafting_round_in_one_op_gives_the_steps_bits(variant, draft_vocab):
    """``draft_block`` (taps appended, block drafted, LM head) against the same round step by step, with
    the taps of one or several rounds pending, buffers outgrown, and gaps (rounds verified without
    taps, before or between pending ones: one op still where those pending run up to the root): the
    same proposals and context."""
    one_op, steps = _drafters(variant, draft_vocab, seed=10, q8_head=True)
    steps._fused = type(one_op._fused)(steps.model)
    assert one_op._lm_head is not None
    steps._lm_head = None
    in_one_op = []
    draft_block = one_op._fused.draft_block
    one_op._fused.draft_block = lambda *args: in_one_op.append(1) or draft_block(*args)
    g = torch.Generator().manual_seed(11)
    width = (len(one_op.target_layer_ids), one_op.model.config.hidden_size)
    committed = rows = 0
    rounds = (((300,), 5), ((2,), 3), ((1, 3), 1), ((-4, 2), 3), ((60, 1), 7), ((), 2), ((2, -1, 3), 2))
    for commits, depth in rounds:  # a negative count: tokens committed without taps
        gap_after_taps = any(a > 0 > b for a, b in itertools.pairwise(commits))
        one_op_round = rows > 0 and not gap_after_taps  # an empty context is projected step by step
        for new in commits:  # rounds that did not draft leave their taps pending
            states = torch.randn(abs(new), *width, generator=g) if new > 0 else None
            for drafter in (one_op, steps):
                drafter.extend_context(states if states is None else states.to(torch.bfloat16), committed)
            committed += abs(new)
            rows += max(new, 0)
        token_ids = torch.randint(0, 90, (committed + 1,), generator=g)
        drafted_in_one_op = len(in_one_op)
        proposals = [drafter.propose(token_ids, depth).log_probs for drafter in (one_op, steps)]
        assert len(in_one_op) == drafted_in_one_op + one_op_round
        assert proposals[0].shape == (depth, 96) and torch.equal(proposals[0], proposals[1])
        assert torch.equal(proposals[0].isinf(), proposals[1].isinf()) and proposals[0].isfinite().any()
        assert one_op._context.length == steps._context.length == rows and not one_op._pending
        for a, b in zip(one_op._context.layers(), steps._context.layers(), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
