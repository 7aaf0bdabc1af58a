"""A training run's config fails when made, naming the bad option, before any model loads."""

from __future__ import annotations

import pytest

from diffdraft.drafters.deer_model import DEER
from diffdraft.errors import InvalidRequestError
from diffdraft.train.config import TrainConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(variant="medusa"),
            r"variant must be one of \['dflash', 'dflare', 'dart', 'deer', 'dflash2', 'dspark'\]",
        ),
        (dict(compute_dtype="float16"), "compute_dtype must be one of"),
        (dict(variant=DEER, stage=3), r"stage must be 1 .* or 2"),
        (dict(variant=DEER, stage=2, max_suffix=0), "max_suffix must be at least 1"),
        (dict(micro_batch_size=0), "micro_batch_size must be at least 1"),
    ],
)
def test_a_bad_option_is_a_clear_error(overrides, message):
    with pytest.raises(InvalidRequestError, match=message):
        TrainConfig("out", **overrides)


def test_anchors_default_to_one_per_six_tokens():
    assert TrainConfig("out").anchors_for(3072) == 512
    assert TrainConfig("out", anchors_per_sequence=7).anchors_for(3072) == 7
