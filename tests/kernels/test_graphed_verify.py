"""The graph-replayed verification forward, run eagerly on a CPU (graphs need CUDA): the logits, taps
and cache of the lean forward it captures, and generations that are the target's own greedy output."""

from __future__ import annotations

import pytest
import torch

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.errors import UnsupportedModelError
from diffdraft.kernels import kv_cache
from diffdraft.kernels.graphed_verify import GraphedVerify
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, DraftTree

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import hf_greedy, tiny_target

PROMPT = [3, 9, 4, 1, 7, 7, 2, 5, 8]
TREE = DraftTree(
    tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
    parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
)
PATH = [0, 2, 4]  # not a prefix of the nodes: the accepted rows move


def _assert_same_cache(ours, theirs) -> None:
    assert ours.get_seq_length() == theirs.get_seq_length()
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(mine.keys, reference.keys)
        torch.testing.assert_close(mine.values, reference.values)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.inference_mode()
def test_rounds_give_the_lean_forwards_logits_taps_and_cache_through_buffer_growth(family, monkeypatch):
    monkeypatch.setattr(kv_cache, "SPARE_ROWS", 4)  # the buffer grows every few rounds
    target = TargetModel(tiny_target(family, seed=7))
    graphed = GraphedVerify(target.lean, capture=False)
    ours, theirs = target.new_cache(), target.new_cache()
    for cache in (ours, theirs):
        target.prefill(cache, torch.tensor(PROMPT), [])
    buffers = set()
    for round_index in range(8):
        tree = TREE if round_index % 3 else None  # trees under a mask, and single tokens
        tokens = tree.tokens if tree is not None else torch.tensor([5])
        start = ours.get_seq_length()
        mask = target.attention_mask(ours, tree.ancestor_mask()) if tree is not None else None
        positions = torch.arange(start, start + len(tokens))
        logits, taps = graphed(ours, tokens, positions, mask, [0, 2])
        expected_logits, expected_taps = target.lean(theirs, tokens, positions, mask, [0, 2])
        torch.testing.assert_close(logits, expected_logits)
        torch.testing.assert_close(taps, expected_taps)
        _assert_same_cache(ours, theirs)
        for cache in (ours, theirs):
            TargetModel.keep_path(cache, start, PATH if tree is not None else [0])
        _assert_same_cache(ours, theirs)
        buffers.add(graphed.buffer)
    assert len(buffers - {None}) >= 2, "the buffer never grew: the test lost its point"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("builder", [ChainBuilder(), DDTreeBuilder(6)], ids=["chain", "ddtree"])
def test_generations_verified_through_it_are_the_targets_greedy_output(family, builder, monkeypatch):
    monkeypatch.setattr(kv_cache, "SPARE_ROWS", 8)
    model = tiny_target(family, seed=11)
    target = TargetModel(model)
    target.graphed = GraphedVerify(target.lean, capture=False)
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    eos = model.config.vocab_size - 1
    for drafter in (None, DFlashDrafter(tiny_drafter(model, 5, block_size=4), target)):
        engine = SpeculativeEngine(target, drafter, builder)
        stop = StopConditions([eos], 30, model.config.max_position_embeddings, len(prompt))
        chunks = engine.run(SequenceSpec(prompt, stop))
        assert [t for chunk in chunks for t in chunk] == hf_greedy(model, prompt, 30, eos)


def test_asking_for_graphs_without_cuda_says_so():
    with pytest.raises(UnsupportedModelError, match="cuda_graphs needs a CUDA target"):
        TargetModel(tiny_target("llama"), cuda_graphs=True)


def test_graphs_refuse_sliding_windows():
    """A captured forward has fixed shapes, and a windowed layer's rows move with the cache."""
    windowed = tiny_target("mistral", sliding_window=5)
    with pytest.raises(UnsupportedModelError, match=r"sliding-window attention.*window of 5"):
        TargetModel(windowed, cuda_graphs=True)
