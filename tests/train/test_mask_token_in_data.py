"""Refusing DEER training data that contains the MASK id."""

from __future__ import annotations

import pytest
import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.train.dataset import TrainingSample
from diffdraft.train.mask_token import refuse_mask_in_data


def test_deer_data_that_contains_the_mask_id_is_refused_naming_the_id_and_the_fix():
    samples = [TrainingSample(f"s{i}", torch.tensor([1, 2, 3 + i]), 1) for i in range(3)]
    refuse_mask_in_data(samples, 9)
    with pytest.raises(InvalidRequestError) as refused:
        refuse_mask_in_data(samples, 4)
    message = str(refused.value)
    assert "the mask token id 4 occurs in 1 training samples (first: s1)" in message
    assert "--mask-token-id" in message and "unused embedding row" in message
