"""The in-place KV cache gives the stock cache's numbers through appends, tree keeps, crops and growth."""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch
from transformers import DynamicCache

from diffdraft.kernels import huge_pages, kv_cache
from diffdraft.kernels.grouped_attention import use_grouped_attention
from diffdraft.kernels.kv_cache import GrowableLayer, growable_cache
from diffdraft.target.model import TargetModel

from diffdraft_testing.targets import tiny_target


@pytest.mark.parametrize(
    ("dtype", "grouped"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_rounds_of_verify_keep_and_crop_match_the_stock_cache(monkeypatch, dtype, grouped):
    monkeypatch.setattr(kv_cache, "SPARE_ROWS", 4)  # grow several times within the test
    model = tiny_target(dtype=dtype, vocab=96, hidden=64, init_std=0.05)
    if grouped:
        assert use_grouped_attention(model)
    target = TargetModel(model)
    generator = torch.Generator().manual_seed(0)
    caches = {
        "stock": DynamicCache(config=model.config),
        "growable": target.new_cache(),
        "per-layer": growable_cache(model.config, shared=False),
    }
    layers = caches["growable"].layers
    assert all(type(layer) is GrowableLayer for layer in layers)
    assert layers[0].shared is not None and layers[0].shared.layers == layers  # one tensor for all
    prompt = torch.randint(0, 96, (11,), generator=generator)
    logits = {name: target.prefill(cache, prompt, []).logits for name, cache in caches.items()}
    assert torch.equal(logits["stock"], logits["growable"]) and torch.equal(
        logits["stock"], logits["per-layer"]
    )
    first_capacity = caches["growable"].layers[0].capacity
    start = prompt.shape[0]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for _ in range(6):
        tokens = torch.randint(0, 96, (4,), generator=generator)
        positions = torch.tensor([0, 1, 1, 2]) + start
        for name, cache in caches.items():
            logits[name] = target.verify(
                cache, tokens, positions, target.attention_mask(cache, tree), []
            ).logits
            TargetModel.keep_path(cache, start, [0, 2, 3])  # not a prefix: rows move, then a crop
        assert torch.equal(logits["stock"], logits["growable"]) and torch.equal(
            logits["stock"], logits["per-layer"]
        )
        start += 3
        assert caches["growable"].get_seq_length() == caches["stock"].get_seq_length() == start
    assert caches["growable"].layers[0].capacity > first_capacity  # it did grow
    for name, cache in caches.items():  # one plain decoding step over the grown cache
        logits[name] = target.verify(cache, tokens[:1], torch.tensor([start]), None, []).logits
    assert torch.equal(logits["stock"], logits["growable"]) and torch.equal(
        logits["stock"], logits["per-layer"]
    )


def test_a_crop_shortens_and_a_positive_count_is_refused():
    cache = growable_cache(tiny_target().config)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 0
    layer.update(torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8))
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and layer.keys.shape == (1, 2, 3, 8)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)


def test_a_shared_buffer_reserves_room_extends_and_crops_every_layer_together():
    """An op that writes rows into the buffer in place: ``reserve`` makes room (growing it, rows kept)
    and says where they go, ``extend`` counts them in every layer (``crop`` drops them from every
    layer); nothing before the first append."""
    cache = growable_cache(tiny_target().config)
    shared = kv_cache.shared_buffer(cache)
    assert shared is not None and shared.reserve(4) is None
    for index, layer in enumerate(cache.layers):
        layer.update(torch.full((1, 2, 5, 8), float(index)), torch.full((1, 2, 5, 8), -float(index)))
    capacity = shared.tensor.shape[-2]
    assert shared.reserve(capacity - 5) == 5 and shared.tensor.shape[-2] == capacity
    assert shared.reserve(capacity) == 5 and shared.tensor.shape[-2] >= capacity + 5
    shared.tensor[:, :, :, :, 5:7] = 7.0
    shared.extend(2)
    for index, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == 7
        assert torch.equal(layer.keys[:, :, :5], torch.full((1, 2, 5, 8), float(index)))
        assert torch.equal(layer.values[:, :, 5:], torch.full((1, 2, 2, 8), 7.0))
    shared.crop(3)  # every layer at once, as DynamicCache.crop(-3) does layer by layer
    for index, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == 4 and layer.keys.shape == (1, 2, 4, 8)
        assert torch.equal(layer.values, torch.full((1, 2, 4, 8), -float(index)))
    assert kv_cache.shared_buffer(growable_cache(tiny_target().config, shared=False)) is None


def test_a_finished_cache_is_freed_without_the_cyclic_garbage_collector():
    """A cycle between the shared buffer and its layers would keep every past sequence's cache alive
    until a full collection, which a process holding many objects runs seldom."""
    model = tiny_target()
    target = TargetModel(model)
    cache = target.new_cache()
    target.prefill(cache, torch.arange(12), [])
    buffer = weakref.ref(cache.layers[0].shared)
    assert buffer().tensor is not None and len(buffer().layers) == model.config.num_hidden_layers
    gc.disable()
    try:
        del cache
        assert buffer() is None
    finally:
        gc.enable()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this platform has no madvise(MADV_HUGEPAGE)")
def test_a_cache_of_a_huge_page_or_more_lives_on_huge_pages_and_keeps_its_rows():
    """Attention streams the cache each forward: a buffer of 2 MB or more is laid on huge pages
    (:mod:`diffdraft.kernels.huge_pages`), zeroed past the rows written, and grows keeping them."""
    cache = growable_cache(tiny_target().config)
    shared = kv_cache.shared_buffer(cache)
    rows = torch.randn(1, 8, 600, 64)
    for index, layer in enumerate(cache.layers):
        layer.update(rows + index, rows - index)
    assert shared.tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not shared.tensor[..., 600:, :].any()
    shared.reserve(shared.tensor.shape[-2])  # grows into a new mapping, rows kept
    assert shared.tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    for index, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys, rows + index) and torch.equal(layer.values, rows - index)
