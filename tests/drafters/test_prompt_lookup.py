"""Prompt lookup's match against its definition, written as the plainest possible search."""

from __future__ import annotations

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
