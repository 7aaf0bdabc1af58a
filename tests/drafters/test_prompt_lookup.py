"""Prompt lookup's match against its definition, written as the plainest possible search."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from diffdraft.drafters.prompt_lookup import PromptLookupDrafter


def latest_match(ids: list[int], depth: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        for begin in range(len(ids) - n - 1, -1, -1):
            if ids[begin : begin + n] == ids[-n:]:
                return n, ids[begin + n : begin + n + depth]
    return 0, []


@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    depth=st.integers(1, 8),
    ngrams=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_match_is_the_longest_ngram_latest_earlier_occurrence(ids, depth, ngrams):
    min_ngram, extra = ngrams
    drafter = PromptLookupDrafter(max_depth=depth, max_ngram=min_ngram + extra, min_ngram=min_ngram)
    assert drafter.match(ids, depth) == latest_match(ids, depth, min_ngram + extra, min_ngram)


def test_match_copies_what_followed_the_latest_occurrence():
    drafter = PromptLookupDrafter(max_ngram=2)
    ids = [7, 1, 2, 3, 4, 1, 2, 5, 6, 9, 1, 2]
    assert drafter.match(ids, 3) == (2, [5, 6, 9])
    assert drafter.match([1, 2, 3], 3) == (0, [])


@given(
    ids=st.lists(st.integers(0, 4), min_size=2, max_size=60),
    steps=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    other=st.lists(st.integers(0, 4), min_size=1, max_size=30),
)
def test_a_context_matched_as_it_grows_matches_as_if_whole_and_another_starts_over(ids, steps, other):
    """The index built over earlier calls answers as a fresh search of the whole context would, and a
    context that does not extend the last one (a fork's next generation, a test's) is searched anew."""
    drafter = PromptLookupDrafter(max_depth=6)
    end = 1
    for step in steps:
        end = min(len(ids), end + step)
        assert drafter.match(ids[:end], 6) == latest_match(ids[:end], 6, 3, 1)
    assert drafter.match(other, 6) == latest_match(other, 6, 3, 1)
    assert drafter.match(ids, 6) == latest_match(ids, 6, 3, 1)


def flat_then(per_token: float):
    """Verification seconds: 1 for the pending token, ``per_token`` for each copied one."""
    return lambda tokens, context: 1.0 + per_token * (tokens - 1)


def test_a_copy_is_cut_to_what_pays_for_its_verification():
    """With a copy's tokens kept half the time (the prior), a free token is always worth verifying,
    a dear one never, and one in between a few; nothing is cut without a cost."""
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6])  # "5 6" repeats: copy 7 8 9 1 2 3 4 5 6
    assert PromptLookupDrafter(max_depth=8).propose(ids, 8).depth == 8
    assert PromptLookupDrafter(max_depth=8, verify_seconds=flat_then(0.0)).propose(ids, 8).depth == 8
    assert PromptLookupDrafter(max_depth=8, verify_seconds=flat_then(1.0)).propose(ids, 8).depth == 0
    # expected 1, 1.5, 1.75, 1.875 over costs 1, 1.1, 1.2, 1.3: 1.46 at two tokens is the best
    assert PromptLookupDrafter(max_depth=8, verify_seconds=flat_then(0.1)).propose(ids, 8).depth == 2


def test_copies_the_target_keeps_get_longer_and_ones_it_refutes_shorter():
    """The cut follows the generation's own record per matched n-gram length: after four 2-gram
    copies were kept whole, a 2-gram copy is verified further; after four missed at once, less; other
    n-gram lengths and a new generation start from the prior again."""
    drafter = PromptLookupDrafter(max_depth=8, verify_seconds=flat_then(0.2))
    assert drafter.paying_length(2, 8, context=100) == 1  # 1.5 / 1.2 = 1.75 / 1.4: the fewest
    for _ in range(4):
        drafter.calibration.copied(0, 2, [1, 2, 3])
        drafter.calibration.score([0, 1, 2, 3])  # kept whole
        drafter.calibration.copied(0, 1, [1, 2, 3])
        drafter.calibration.score([0, 9])  # missed at once
    assert drafter.paying_length(2, 8, context=100) == 3
    assert drafter.paying_length(1, 8, context=100) == 0
    assert drafter.paying_length(3, 8, context=100) == 1
    drafter.reset()
    assert drafter.paying_length(2, 8, context=100) == 1
