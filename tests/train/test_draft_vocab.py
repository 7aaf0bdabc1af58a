"""Draft vocabulary: the most frequent response tokens, and how much of the output they cover."""

from __future__ import annotations

import pytest
import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.train.dataset import TrainingSample
from diffdraft.train.draft_vocab import coverage, frequent_tokens


def sample(ids: list[int], response_start: int) -> TrainingSample:
    return TrainingSample("s", torch.tensor(ids), response_start)


SAMPLES = [sample([9, 9, 9, 9, 4, 4, 7, 1], 4), sample([9, 2, 7, 7, 3], 2)]
"""Responses: [4, 4, 7, 1] and [7, 7, 3] -> counts 7:3, 4:2, then 1, 3 once each; prompt 9s never count."""


def test_the_most_frequent_response_tokens_are_chosen_and_ties_go_to_the_lower_id():
    assert frequent_tokens(SAMPLES, 10, 2).tolist() == [4, 7]
    assert frequent_tokens(SAMPLES, 10, 3).tolist() == [1, 4, 7]


def test_slots_left_after_every_seen_token_go_to_the_lowest_unseen_ids():
    assert frequent_tokens(SAMPLES, 10, 6).tolist() == [0, 1, 2, 3, 4, 7]
    assert frequent_tokens(SAMPLES, 10, 50).tolist() == list(range(10))


def test_coverage_is_the_share_of_response_tokens_inside_the_vocabulary():
    assert coverage(SAMPLES, torch.tensor([4, 7]), 10) == pytest.approx(5 / 7)


def test_an_empty_vocabulary_is_refused():
    with pytest.raises(InvalidRequestError, match="at least 1"):
        frequent_tokens(SAMPLES, 10, 0)
