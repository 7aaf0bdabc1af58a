"""Target features cached on disk: equal to online capture, and any subset of layers can be read."""

from __future__ import annotations

import pytest
import torch

from diffdraft.target.model import TargetModel
from diffdraft.train.features import CachedFeatures, OnlineFeatures, capture_features

from diffdraft_testing.targets import tiny_target


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_target("llama", seed=2, layers=4))


def test_a_cache_of_many_layers_serves_a_drafter_that_taps_some_of_them(target, tmp_path):
    ids = torch.arange(3, 15)
    capture_features(target, [0, 1, 2, 3], [("a", ids)], tmp_path, dtype=torch.float64)
    subset = CachedFeatures(tmp_path, [3, 1])("a", ids)
    torch.testing.assert_close(subset, OnlineFeatures(target, [3, 1])("a", ids))


def test_a_drafter_tapping_an_uncached_layer_is_told_to_capture_again(target, tmp_path):
    capture_features(target, [0, 2], [("a", torch.arange(5))], tmp_path)
    with pytest.raises(ValueError, match=r"also taps \[1\]: capture again"):
        CachedFeatures(tmp_path, [0, 1])


def test_samples_missing_from_the_cache_fall_back_to_online_capture_or_fail_clearly(target, tmp_path):
    capture_features(target, [0, 2], [("a", torch.arange(5))], tmp_path, dtype=torch.float64)
    online = OnlineFeatures(target, [0, 2])
    ids = torch.arange(4, 11)
    torch.testing.assert_close(CachedFeatures(tmp_path, [0, 2], fallback=online)("b", ids), online("b", ids))
    with pytest.raises(KeyError, match="'b' is not in the feature cache"):
        CachedFeatures(tmp_path, [0, 2])("b", ids)
