"""NgramTrie lookups against a plain-Python stupid-backoff reference; format checks on load."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter

import numpy as np
import pytest

from diffdraft.errors import CheckpointError, IncompatibleDrafterError
from diffdraft.ngram import NgramTrie, tokenizer_fingerprint
from diffdraft.ngram.build import TrieSettings, build_trie
from diffdraft.ngram.trie import ALPHA, EPS, META_FILE

from diffdraft_testing.checkpoints import tiny_tokenizer

VOCAB = 24


def random_documents(seed: int = 0, count: int = 60) -> list[list[int]]:
    """Skewed token draws so that some trigrams repeat and others are seen once."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(VOCAB - 4)]  # ids 20..23 never occur
    return [rng.choices(range(VOCAB - 4), weights, k=rng.randrange(0, 50)) for _ in range(count)]


def reference_counts(documents: list[list[int]], order: int = 3) -> Counter:
    counts: Counter = Counter()
    for doc in documents:
        for n in range(1, order + 1):
            for start in range(len(doc) - n + 1):
                counts[tuple(doc[start : start + n])] += 1
    return counts


class Reference:
    """Stupid backoff straight from the definition in diffdraft.ngram.trie, over a Counter."""

    def __init__(self, counts: Counter, order: int, min_count: int = 1) -> None:
        self.order = order
        self.counts = Counter({k: c for k, c in counts.items() if len(k) < order or c >= min_count})
        self.total = sum(c for k, c in counts.items() if len(k) == 1)

    def has_children(self, history: tuple) -> bool:
        return any(len(k) == len(history) + 1 and k[:-1] == history for k in self.counts)

    def score(self, context: list[int], token: int) -> float:
        history = tuple(context[max(0, len(context) - (self.order - 1)) :]) if self.order > 1 else ()
        while history and not (history in self.counts and self.has_children(history)):
            history = history[1:]
        penalty = 1.0
        while history:
            if self.counts.get((*history, token)):
                return penalty * self.counts[(*history, token)] / self.counts[history]
            penalty *= ALPHA
            history = history[1:]
        return penalty * self.counts.get((token,), 0) / self.total

    def log_probs(self, context: list[int], tokens: list[int]) -> np.ndarray:
        return np.log(np.array([self.score(context, t) for t in tokens]) + EPS)


def build(tmp_path, documents, name="trie", order=3, min_count=1, **options) -> NgramTrie:
    settings = TrieSettings(order=order, vocab_size=VOCAB, tokenizer_hash="sha256:test", min_count=min_count)
    batches = [documents[i : i + 8] for i in range(0, len(documents), 8)]
    build_trie(batches, tmp_path / name, settings, **options)
    return NgramTrie.load(tmp_path / name)


@pytest.fixture(scope="module")
def corpus():
    documents = random_documents()
    return documents, reference_counts(documents)


@pytest.fixture(scope="module")
def trie(corpus, tmp_path_factory):
    return build(tmp_path_factory.mktemp("ngram"), corpus[0])


def contexts(corpus) -> list[list[int]]:
    documents, counts = corpus
    seen_bigram = next(k for k, c in counts.most_common() if len(k) == 2)
    return [
        [],  # unigram
        [seen_bigram[1]],  # one token of context
        list(seen_bigram),  # a seen bigram: trigram children
        [21, seen_bigram[1]],  # unseen first token (never in the corpus): free backoff to one token
        [21, 22],  # nothing seen: unigram
        documents[0][:30],  # long context: only the last two tokens count
        [7, 5],
        [0, 0],
    ]


def test_metadata(trie, corpus):
    documents, counts = corpus
    assert trie.order == 3 and trie.vocab_size == VOCAB and trie.tokenizer_hash == "sha256:test"
    assert trie.token_count == sum(len(d) for d in documents)
    assert trie.nodes_per_level == [sum(len(k) == n for k in counts) for n in (1, 2, 3)]


def test_log_probs_match_the_reference(trie, corpus):
    reference = Reference(corpus[1], 3)
    candidates = list(range(VOCAB))
    for context in contexts(corpus):
        got = trie.log_probs(context, candidates)
        assert got.dtype == np.float32 and got.shape == (VOCAB,)
        np.testing.assert_allclose(got, reference.log_probs(context, candidates), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_a_beam_of_contexts_at_once_gives_each_context_its_own_lookup(tmp_path, corpus, order):
    trie = build(tmp_path, corpus[0], order=order)
    rng = random.Random(order)
    beam = [*contexts(corpus)[:12], [], [VOCAB + 5, 3], [-1], [21, 22, 23]]  # unseen and out-of-range too
    for _ in range(5):
        candidates = [rng.randrange(-2, VOCAB + 3) for _ in range(rng.randrange(0, 30))]
        expected = np.stack([trie.log_probs(context, candidates) for context in beam])
        got = trie.log_probs_many(beam, candidates)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)
    assert trie.log_probs_many([], [1, 2]).shape == (0, 2)


def test_memoized_backoff_chains_stay_right_as_the_cache_starts_over(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr("diffdraft.ngram.trie.CHAIN_CACHE_SIZE", 3)
    trie = build(tmp_path, corpus[0])
    reference = Reference(corpus[1], 3)
    candidates = list(range(VOCAB))
    asked = contexts(corpus) * 2 + contexts(corpus)[::-1]
    for context in asked:
        np.testing.assert_allclose(
            trie.log_probs(context, candidates),
            reference.log_probs(context, candidates),
            rtol=1e-6,
            atol=1e-6,
        )
    assert len(trie._chains) <= 3


def test_seen_trigram_is_relative_frequency(trie, corpus):
    counts = corpus[1]
    (a, b, c), count = next((k, n) for k, n in counts.most_common() if len(k) == 3)
    expected = math.log(count / counts[(a, b)] + EPS)
    assert trie.log_probs([a, b], [c])[0] == pytest.approx(expected, rel=1e-6)


def test_backoff_to_bigram_and_unigram(trie, corpus):
    counts = corpus[1]
    seen = [t for t in range(VOCAB) if (t,) in counts]

    def backoff_case(a, b):
        bigram_only = [t for t in seen if (a, b, t) not in counts and (b, t) in counts]
        unigram_only = [t for t in seen if (b, t) not in counts]
        return (a, b, bigram_only[0], unigram_only[0]) if bigram_only and unigram_only else None

    cases = (backoff_case(*k) for k, _ in counts.most_common() if len(k) == 2)
    a, b, bigram_only, unigram_only = next(case for case in cases if case)
    expected = math.log(ALPHA * counts[(b, bigram_only)] / counts[(b,)] + EPS)
    assert trie.log_probs([a, b], [bigram_only])[0] == pytest.approx(expected, rel=1e-6)
    expected = math.log(ALPHA**2 * counts[(unigram_only,)] / trie.token_count + EPS)
    assert trie.log_probs([a, b], [unigram_only])[0] == pytest.approx(expected, rel=1e-6)


def test_unseen_and_out_of_range_tokens_get_the_floor(trie):
    floor = np.float32(math.log(EPS))
    got = trie.log_probs([1, 2], [20, 23, VOCAB, 10**9, -1])
    assert np.all(got == floor)


def test_empty_context_is_unigram(trie, corpus):
    counts = corpus[1]
    got = trie.log_probs([], [0, 1, 20])
    expected = [math.log(counts[(t,)] / trie.token_count + EPS) for t in (0, 1, 20)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_long_context_uses_only_its_last_tokens(trie, corpus):
    documents = corpus[0]
    context = documents[0][:30]
    np.testing.assert_array_equal(
        trie.log_probs(context, range(VOCAB)), trie.log_probs(context[-2:], range(VOCAB))
    )
    assert np.array_equal(
        trie.log_probs(np.array(context), np.arange(VOCAB)), trie.log_probs(context, range(VOCAB))
    )


def test_children_are_sorted_complete_and_agree_with_log_probs(trie, corpus):
    counts = corpus[1]
    for context in contexts(corpus):
        ids, scores = trie.children(context)
        assert ids.dtype == np.int64 and scores.dtype == np.float32
        assert np.all(np.diff(ids) > 0)
        np.testing.assert_array_equal(scores, trie.log_probs(context, ids))
    (a, b), _ = next((k, n) for k, n in counts.most_common() if len(k) == 2)
    ids, _ = trie.children([5, a, b])
    assert ids.tolist() == sorted(k[2] for k in counts if len(k) == 3 and k[:2] == (a, b))
    ids, _ = trie.children([])
    assert ids.tolist() == sorted(k[0] for k in counts if len(k) == 1)


def test_min_count_prunes_only_the_top_level(tmp_path, corpus):
    documents, counts = corpus
    pruned = build(tmp_path, documents, min_count=2)
    assert pruned.nodes_per_level[:2] == [sum(len(k) == n for k in counts) for n in (1, 2)]
    assert pruned.nodes_per_level[2] == sum(1 for k, c in counts.items() if len(k) == 3 and c >= 2)
    assert pruned.meta["min_count"] == 2
    reference = Reference(counts, 3, min_count=2)
    for context in contexts(corpus):
        np.testing.assert_allclose(
            pruned.log_probs(context, range(VOCAB)),
            reference.log_probs(context, list(range(VOCAB))),
            rtol=1e-6,
            atol=1e-6,
        )


@pytest.mark.parametrize("order", [1, 2, 4])
def test_other_orders(tmp_path, corpus, order):
    documents = corpus[0]
    trie = build(tmp_path, documents, order=order)
    reference = Reference(reference_counts(documents, order), order)
    for context in contexts(corpus):
        np.testing.assert_allclose(
            trie.log_probs(context, range(VOCAB)), reference.log_probs(context, list(range(VOCAB))), atol=1e-6
        )


def test_arrays_are_memory_mapped_and_compact(trie):
    assert all(
        isinstance(np.load(trie.path / f"tokens_{k}.npy", mmap_mode="r"), np.memmap) for k in (1, 2, 3)
    )
    dtypes = trie.meta["arrays"]
    assert dtypes["tokens_1.npy"] == "uint16" and dtypes["offsets_1.npy"] == "uint32"
    assert dtypes["counts_3.npy"] in {"uint16", "uint32"}


# ---------------------------------------------------------------------------------------- broken tries


@pytest.fixture
def copy(trie, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(trie.path, target)
    return target


def _edit_meta(path, **changes):
    meta = json.loads((path / META_FILE).read_text())
    meta.update(changes)
    (path / META_FILE).write_text(json.dumps(meta))


def _one_line_checkpoint_error(path, *needles):
    with pytest.raises(CheckpointError) as error:
        NgramTrie.load(path)
    message = str(error.value)
    assert "\n" not in message and "diffdraft ngram build" in message
    for needle in needles:
        assert needle in message
    return message


def test_missing_directory(tmp_path):
    _one_line_checkpoint_error(tmp_path / "nowhere", "no such N-gram trie directory")


def test_missing_meta(copy):
    (copy / META_FILE).unlink()
    _one_line_checkpoint_error(copy, META_FILE)


def test_missing_array(copy):
    (copy / "offsets_2.npy").unlink()
    _one_line_checkpoint_error(copy, "offsets_2.npy")


def test_unknown_version(copy):
    _edit_meta(copy, version=99)
    _one_line_checkpoint_error(copy, "version 99")


def test_wrong_format_name(copy):
    _edit_meta(copy, format="something-else")
    _one_line_checkpoint_error(copy, "something-else")


def test_meta_not_json(copy):
    (copy / META_FILE).write_text("{not json")
    _one_line_checkpoint_error(copy, "not JSON")


def test_inconsistent_node_counts(copy, trie):
    nodes = list(trie.nodes_per_level)
    nodes[0] += 1
    _edit_meta(copy, nodes_per_level=nodes)
    _one_line_checkpoint_error(copy, "inconsistent", "shape")


def test_truncated_array(copy):
    data = (copy / "counts_3.npy").read_bytes()
    (copy / "counts_3.npy").write_bytes(data[: len(data) // 2])
    _one_line_checkpoint_error(copy, "counts_3.npy")


def test_offsets_not_matching_children(copy, trie):
    offsets = np.load(copy / "offsets_1.npy")
    offsets[-1] -= 1
    np.save(copy / "offsets_1.npy", offsets)
    _one_line_checkpoint_error(copy, "offsets_1.npy")


# ---------------------------------------------------------------------------------------- tokenizers


def test_check_tokenizer(tmp_path, corpus):
    tokenizer = tiny_tokenizer()
    settings = TrieSettings(
        order=3, vocab_size=len(tokenizer), tokenizer_hash=tokenizer_fingerprint(tokenizer)
    )
    build_trie([[[5, 6, 7, 5, 6]]], tmp_path / "t", settings, describe={"tokenizer": {"name": "tiny"}})
    trie = NgramTrie.load(tmp_path / "t")
    trie.check_tokenizer(tokenizer)
    other = tiny_tokenizer()
    other.add_tokens(["<other>"])
    with pytest.raises(IncompatibleDrafterError) as error:
        trie.check_tokenizer(other)
    message = str(error.value)
    assert trie.tokenizer_hash in message and tokenizer_fingerprint(other) in message
    assert "diffdraft ngram build --target" in message and "\n" not in message


def test_token_arrays_of_mixed_dtypes(copy):
    np.save(copy / "tokens_2.npy", np.load(copy / "tokens_2.npy").astype(np.int64))
    _one_line_checkpoint_error(copy, "tokens_2.npy", "dtype")


def test_no_candidates(trie):
    got = trie.log_probs([1, 2], [])
    assert got.shape == (0,) and got.dtype == np.float32
