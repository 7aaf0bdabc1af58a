"""Tree verification, layer taps and KV compaction against plain forwards."""

from __future__ import annotations

import pytest
import torch

from diffdraft.errors import IncompatibleDrafterError, InvalidRequestError
from diffdraft.kernels.attention_window import FULL, SLIDING, layer_mask
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree

from diffdraft_testing.targets import tiny_target, windowed_target

PROMPT = [3, 9, 4, 1, 7, 7, 2]


def branching_tree() -> DraftTree:
    """root -> {a, b}; a -> {c}; b -> {d, e}; d -> {f}  (a path through b, d, f is not a prefix)."""
    return DraftTree(
        tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
        parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
        depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
    )


def mask(target: TargetModel, cache, tree: DraftTree) -> torch.Tensor:
    return target.attention_mask(cache, tree.ancestor_mask())


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    tokens = []
    while node >= 0:
        tokens.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tokens[::-1]


def test_an_empty_prompt_is_refused_before_any_forward():
    target = TargetModel(tiny_target())
    cache = target.new_cache()
    with pytest.raises(InvalidRequestError, match="at least one prompt token"):
        target.prefill(cache, torch.tensor([], dtype=torch.long), [])
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tree_logits_equal_plain_forward_of_each_branch(family):
    model = tiny_target(family, seed=2)
    target = TargetModel(model)
    tree = branching_tree()
    cache = target.new_cache()
    target.prefill(cache, torch.tensor(PROMPT), [])
    out = target.verify(cache, tree.tokens, tree.position_ids(len(PROMPT)), mask(target, cache, tree), [])
    for node in range(len(tree.tokens)):
        sequence = torch.tensor([PROMPT + path_tokens(tree, node)])
        expected = model(sequence).logits[0, -1]
        torch.testing.assert_close(out.logits[node], expected)


def test_layer_id_i_taps_the_output_of_decoder_layer_i():
    model = tiny_target("qwen3", seed=1, layers=4)
    outputs = {}
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out, i=i: outputs.__setitem__(i, out))
        for i, layer in enumerate(model.model.layers)
    ]
    target = TargetModel(model)
    out = target.prefill(target.new_cache(), torch.tensor(PROMPT), [0, 2, 3])
    for hook in hooks:
        hook.remove()
    assert out.hidden.shape == (len(PROMPT), 3, model.config.hidden_size)
    for column, layer_id in enumerate([0, 2]):
        layer_out = outputs[layer_id][0] if isinstance(outputs[layer_id], tuple) else outputs[layer_id]
        torch.testing.assert_close(out.hidden[:, column], layer_out[0])
    # the last layer's tap is Hugging Face's hidden_states[L], which carries the final norm
    expected_last = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[4][0]
    torch.testing.assert_close(out.hidden[:, 2], expected_last)


@pytest.mark.parametrize("accepted_leaf", [0, 1, 3, 4, 6])
def test_cache_after_keep_path_equals_fresh_forward_over_accepted_tokens(accepted_leaf):
    model = tiny_target("llama", seed=4)
    target = TargetModel(model)
    tree = branching_tree()
    cache = target.new_cache()
    target.prefill(cache, torch.tensor(PROMPT), [])
    target.verify(cache, tree.tokens, tree.position_ids(len(PROMPT)), mask(target, cache, tree), [])
    path = []
    node = accepted_leaf
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    target.keep_path(cache, len(PROMPT), path[::-1])

    fresh = target.new_cache()
    target.prefill(fresh, torch.tensor(PROMPT + path_tokens(tree, accepted_leaf)), [])
    assert cache.get_seq_length() == fresh.get_seq_length() == len(PROMPT) + len(path)
    for kept, expected in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(kept.keys, expected.keys)
        torch.testing.assert_close(kept.values, expected.values)


def test_out_of_range_layer_ids_are_rejected_with_the_valid_range():
    target = TargetModel(tiny_target("llama", layers=4))
    with pytest.raises(IncompatibleDrafterError, match=r"\[0, 3\]"):
        target.check_layer_ids([1, 4])


@pytest.mark.parametrize("layer_ids", [[0], [2, 0, 1], [1, 3], [3]])
def test_taps_stop_early_and_equal_prefill_taps(layer_ids):
    target = TargetModel(tiny_target("qwen3", seed=4))
    ids = torch.tensor(PROMPT)
    full = target.prefill(target.new_cache(), ids, layer_ids).hidden
    ran = []
    for layer in target.model.get_decoder().layers[max(layer_ids) + 1 :]:
        layer.register_forward_hook(lambda *_: ran.append(1))
    torch.testing.assert_close(target.taps(ids, layer_ids), full, rtol=0, atol=0)
    assert not ran, "layers after the deepest tap ran"


@pytest.mark.parametrize("layer_ids", [[0, 2], [3]])
def test_right_padded_sequences_get_the_taps_and_logits_each_gets_alone(layer_ids):
    target = TargetModel(tiny_target("qwen3", seed=4, dtype=torch.float64))
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(1, 60, (n,), generator=generator) for n in (9, 14, 5)]
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    taps = target.taps(padded, layer_ids)
    batch = target.taps_and_logits(padded, layer_ids)
    for i, ids in enumerate(sequences):
        alone = target.taps_and_logits(ids, layer_ids)
        n = ids.shape[0]
        torch.testing.assert_close(taps[i, :n], alone.hidden)
        torch.testing.assert_close(batch.hidden[i, :n], alone.hidden)
        torch.testing.assert_close(batch.logits[i, :n], alone.logits)


def test_a_windowed_node_sees_the_last_window_of_positions_among_context_and_its_ancestors():
    target = TargetModel(windowed_target("gemma3", 3))
    cache = target.new_cache()
    target.prefill(cache, torch.tensor([1, 2, 3, 4]), [])
    # a root at position 4 and two children at 5
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    masks = target.attention_mask(cache, tree)
    assert set(masks) == {FULL, SLIDING} and layer_mask(masks, FULL).shape == (1, 1, 3, 7)
    full, windowed = ((masks[kind][0, 0] == 0).int().tolist() for kind in (FULL, SLIDING))
    assert full == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    assert windowed == [[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 1]]
    assert layer_mask(None, SLIDING) is None
