"""diffdraft's lean verification forward against stock transformers' forward: logits, taps and cache rows
bit for bit, over diffdraft's cache and over transformers' own sliding cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from diffdraft.kernels.attention_window import SLIDING, window_start
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree

PROMPT = [3, 9, 4, 1, 7, 7, 2, 5, 8]
"""The prompt both forwards prefill."""
TREE = DraftTree(
    tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
    parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
)
"""A tree both forwards verify after :data:`PROMPT`: siblings, and a path that is no prefix of another."""


def _hugging_face_verify(target: TargetModel, cache, tree: DraftTree | None, layer_ids: list[int]):
    """The verification forward through the model's own ``forward``."""
    tokens = tree.tokens if tree is not None else torch.tensor([5])
    start = cache.get_seq_length()
    mask = target.attention_mask(cache, tree.ancestor_mask()) if tree is not None else None
    with torch.inference_mode():
        return target._forward(cache, tokens, torch.arange(start, start + len(tokens)), mask, layer_ids, 0)


def assert_same_as_hugging_face(model: torch.nn.Module, layer_ids: list[int]) -> None:
    """After a prefill of :data:`PROMPT`, :data:`TREE` under its mask and one token over the whole
    cache: the lean forward against the model's own ``forward`` over the same cache, logits, taps and
    cache bit for bit."""
    target = TargetModel(model)
    assert target.lean is not None
    for tree in (TREE, None):  # a tree under a mask, and one token over the whole cache
        ours, theirs = target.new_cache(), target.new_cache()
        for cache in (ours, theirs):
            target.prefill(cache, torch.tensor(PROMPT), [])
        start = len(PROMPT)
        tokens = tree.tokens if tree is not None else torch.tensor([5])
        mask = target.attention_mask(ours, tree.ancestor_mask()) if tree is not None else None
        out = target.verify(ours, tokens, torch.arange(start, start + len(tokens)), mask, layer_ids)
        expected = _hugging_face_verify(target, theirs, tree, layer_ids)
        assert torch.equal(out.logits, expected.logits)
        assert torch.equal(out.hidden, expected.hidden) if layer_ids else out.hidden is None
        for mine, reference in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)


def _visible(mask, windows, past: int):
    """``mask`` with a windowed layer's columns from :func:`window_start` on: the keys Hugging Face's
    own sliding cache holds (its last ``window - 1`` rows) and the new ones."""
    start = window_start(past, windows.window)
    if isinstance(mask, dict):
        return {kind: m[..., start:] if kind == SLIDING else m for kind, m in mask.items()}
    return mask[..., start:]


def _assert_same_rows(ours, theirs) -> None:
    """Every row Hugging Face's cache holds (a sliding layer: its last rows) equals ours."""
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        rows = reference.keys.shape[-2]
        assert torch.equal(mine.keys[:, :, -rows:], reference.keys)
        assert torch.equal(mine.values[:, :, -rows:], reference.values)


def assert_windowed_same_as_hugging_face(model, layer_ids: list[int]) -> None:
    """A prefill longer than the window, one-token steps past it, then a tree: the lean forward over
    diffdraft's cache against stock transformers over its own ``DynamicCache`` (sliding layers that
    drop old rows), logits, taps and cache rows bit for bit."""
    target = TargetModel(model)
    assert target.lean is not None and target.windows.window is not None
    assert target.lean.fused is None
    ours, theirs = target.new_cache(), DynamicCache(config=model.config)
    assert any(getattr(layer, "is_sliding", False) for layer in theirs.layers)

    def theirs_forward(tokens, positions, mask):
        with torch.inference_mode():
            out = model(
                input_ids=tokens[None],
                position_ids=positions[None],
                attention_mask=mask,
                cache=theirs,
                use_cache=True,
                output_hidden_states=bool(layer_ids),
            )
        taps = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1) if layer_ids else None
        return out.logits[0], taps

    def check(tokens, mine, reference):
        logits, taps = mine
        assert logits.shape[0] == tokens.shape[0] and torch.equal(logits, reference[0])
        assert torch.equal(taps, reference[1]) if layer_ids else taps is None
        _assert_same_rows(ours, theirs)

    prompt = torch.tensor(PROMPT)
    positions = torch.arange(len(PROMPT))
    causal = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    with torch.inference_mode():  # Hugging Face builds its own causal masks for the prefill and steps
        mine = target.lean(ours, prompt, positions, target.attention_mask(ours, causal), layer_ids)
    check(prompt, mine, theirs_forward(prompt, positions, None))
    for token in (5, 11, 2, 7):
        step, at = torch.tensor([token]), torch.tensor([ours.get_seq_length()])
        with torch.inference_mode():
            mine = target.lean(ours, step, at, None, layer_ids)
        check(step, mine, theirs_forward(step, at, None))
    past = ours.get_seq_length()
    mask = target.attention_mask(ours, TREE.ancestor_mask())
    assert isinstance(mask, dict) == target.windows.by_type
    positions = past + TREE.depths
    out = target.verify(ours, TREE.tokens, positions, mask, layer_ids)
    check(
        TREE.tokens,
        (out.logits, out.hidden),
        theirs_forward(TREE.tokens, positions, _visible(mask, target.windows, past)),
    )
