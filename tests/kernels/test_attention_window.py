"""Each layer's window read from the config as Hugging Face reads it, and the masks that apply it."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from diffdraft.kernels.attention_window import FULL, SLIDING, LayerWindows, window_start

from diffdraft_testing.targets import WINDOWED_FAMILIES, tiny_target, windowed_target


def test_every_family_reads_the_windows_its_own_cache_keeps():
    for family in WINDOWED_FAMILIES:
        config = windowed_target(family, 3).config
        windows = LayerWindows.of(config)
        sliding = [layer.is_sliding for layer in DynamicCache(config=config).layers]
        assert [kind == SLIDING for kind in windows.types] == sliding, family
        assert windows.window == 3 and windows.windowed_layers == [i for i, s in enumerate(sliding) if s]
    for family in ["llama", "qwen2", "qwen3"]:
        windows = LayerWindows.of(tiny_target(family).config)
        assert windows.window is None and set(windows.types) == {FULL}


def test_uniform_windows_give_one_mask_and_the_first_visible_row():
    windows = LayerWindows.of(windowed_target("mistral", 4).config)
    full = torch.zeros(1, 1, 1, 6)
    mask = windows.mask(full, torch.tensor([5]), torch.arange(6))
    assert isinstance(mask, torch.Tensor) and (mask[0, 0, 0] == 0).tolist() == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert [window_start(past, 4) for past in (0, 3, 5, 9)] == [0, 0, 2, 6]
    assert window_start(9, None) == 0
