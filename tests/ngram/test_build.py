"""Building tries from jsonl sources: counts, chunking and spilling, pruning, cleaning, safe output."""

from __future__ import annotations

import json
import os
import types
from collections import Counter

import numpy as np
import pytest

import diffdraft.ngram.build
from diffdraft.errors import InvalidRequestError
from diffdraft.ngram import NgramTrie, tokenizer_fingerprint
from diffdraft.ngram.build import (
    TrieSettings,
    build_from_sources,
    build_trie,
    check_order,
    target_tokenizer,
)
from diffdraft.ngram.trie import EPS

from diffdraft_testing.checkpoints import tiny_tokenizer

RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the quick fox"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "the quick brown fox"},
            {"from": "gpt", "value": "hello fox"},
        ]
    },
    {"prompt": "hello world, the quick brown fox jumps"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the brown world"}]},
    {
        "messages": [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the quick fox"},
        ]
    },
    {"prompt": "quick quick brown brown fox fox hello hello world world"},
]


def documents_of(records) -> list[str]:
    """What the build reads: every message and the first reply, duplicates (same texts) once."""
    texts, seen = [], set()
    for record in records:
        turns = (
            record.get("messages")
            or [{"content": t["value"]} for t in record.get("conversations", [])]
            or [{"content": record["prompt"]}]
        )
        contents = tuple(t["content"] for t in turns)
        if contents not in seen:
            seen.add(contents)
            texts.extend(contents)
    return texts


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def counts_of(tokenizer, texts, order=3) -> Counter:
    counts: Counter = Counter()
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        for n in range(1, order + 1):
            for start in range(len(ids) - n + 1):
                counts[tuple(ids[start : start + n])] += 1
    return counts


def arrays(trie: NgramTrie) -> dict[str, np.ndarray]:
    return {f.name: np.load(f) for f in sorted(trie.path.glob("*.npy"))}


def test_counts_match_the_tokenized_corpus(tmp_path, source, tokenizer):
    report = build_from_sources(
        tokenizer, [source], tmp_path / "trie", min_count=1, decontaminate=False, progress=False
    )
    trie = NgramTrie.load(tmp_path / "trie")
    counts = counts_of(tokenizer, documents_of(RECORDS))
    assert report.duplicates == 1 and report.prompts == len(RECORDS)
    assert trie.token_count == report.tokens == sum(c for k, c in counts.items() if len(k) == 1)
    assert trie.nodes_per_level == [sum(len(k) == n for k in counts) for n in (1, 2, 3)]
    assert trie.meta["corpus"]["sources"] == [source] and trie.meta["corpus"]["documents"] == 8
    assert trie.tokenizer_hash == tokenizer_fingerprint(tokenizer)
    (a, b, c), count = next((k, n) for k, n in counts.most_common() if len(k) == 3)
    expected = np.log(count / counts[(a, b)] + EPS)
    assert trie.log_probs([a, b], [c])[0] == pytest.approx(expected, rel=1e-6)
    ids, _ = trie.children([a, b])
    assert ids.tolist() == sorted(k[2] for k in counts if len(k) == 3 and k[:2] == (a, b))
    trie.check_tokenizer(tokenizer)


def test_chunked_spilled_build_equals_one_chunk_build(tmp_path, source, tokenizer, monkeypatch):
    options = dict(min_count=2, decontaminate=False, progress=False)
    build_from_sources(tokenizer, [source], tmp_path / "one", **options)
    merges = []
    kway_merge = diffdraft.ngram.build._kway_merge
    monkeypatch.setattr(
        diffdraft.ngram.build,
        "_kway_merge",
        lambda runs, block: merges.append(len(runs)) or kway_merge(runs, block),
    )
    build_from_sources(
        tokenizer, [source], tmp_path / "many", chunk_chars=10, spill_entries=2, merge_block=1, **options
    )
    assert len(merges) == 3 and min(merges) > 2  # every order spilled several runs
    one, many = arrays(NgramTrie.load(tmp_path / "one")), arrays(NgramTrie.load(tmp_path / "many"))
    assert one.keys() == many.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], many[name], err_msg=name)
        assert one[name].dtype == many[name].dtype


def test_min_count_drops_rare_top_level_ngrams_only(tmp_path, source, tokenizer):
    build_from_sources(
        tokenizer, [source], tmp_path / "trie", min_count=2, decontaminate=False, progress=False
    )
    trie = NgramTrie.load(tmp_path / "trie")
    counts = counts_of(tokenizer, documents_of(RECORDS))
    assert trie.nodes_per_level == [
        sum(len(k) == 1 for k in counts),
        sum(len(k) == 2 for k in counts),
        sum(1 for k, c in counts.items() if len(k) == 3 and c >= 2),
    ]
    assert 0 < trie.nodes_per_level[2] < sum(len(k) == 3 for k in counts)


def test_decontamination_drops_eval_copies_and_the_held_out_slice(tmp_path, source, tokenizer, monkeypatch):
    import diffdraft.data.prompts
    import diffdraft.data.samples

    eval_text = "quick quick brown brown fox fox hello hello world world and more words"
    monkeypatch.setattr(diffdraft.data.prompts, "eval_texts", lambda: [eval_text])
    held = types.SimpleNamespace(id="corpus:4", messages=[{"role": "user", "content": "the brown world"}])
    monkeypatch.setattr(diffdraft.data.samples, "sharegpt_held_out", lambda: [held])
    monkeypatch.setattr("diffdraft.ngram.build.DECONTAMINATION_NGRAM", 10)
    report = build_from_sources(tokenizer, [source], tmp_path / "trie", min_count=1, progress=False)
    assert (report.duplicates, report.held_out, report.contaminated) == (1, 1, 1)
    kept = [RECORDS[i] for i in (0, 1, 2)]
    counts = counts_of(tokenizer, documents_of(kept))
    trie = NgramTrie.load(tmp_path / "trie")
    assert trie.token_count == sum(c for k, c in counts.items() if len(k) == 1)
    assert trie.meta["corpus"]["decontaminated"] is True
    assert trie.meta["corpus"]["contaminated_dropped"] == 1


def test_refuses_to_overwrite_other_things(tmp_path, source, tokenizer):
    options = dict(decontaminate=False, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(InvalidRequestError, match="--force"):
        build_from_sources(tokenizer, [source], other, **options)
    assert (other / "notes.txt").read_text() == "mine"

    out = tmp_path / "trie"
    build_from_sources(tokenizer, [source], out, **options)
    build_from_sources(tokenizer, [source], out, **options)  # same settings: replaced
    with pytest.raises(InvalidRequestError, match=r"order 3 \(now 2\)"):
        build_from_sources(tokenizer, [source], out, order=2, **options)
    build_from_sources(tokenizer, [source], out, order=2, force=True, **options)
    assert NgramTrie.load(out).order == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    build_from_sources(tokenizer, [source], empty, **options)
    assert NgramTrie.load(empty).order == 3
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left behind


def test_interrupted_build_leaves_nothing(tmp_path):
    def batches():
        yield [[1, 2, 3, 1, 2, 3]]
        raise KeyboardInterrupt

    settings = TrieSettings(order=3, vocab_size=8, tokenizer_hash="x")
    with pytest.raises(KeyboardInterrupt):
        build_trie(batches(), tmp_path / "trie", settings)
    assert os.listdir(tmp_path) == []


def test_the_trie_directory_gets_the_umask_mode_not_a_private_one(tmp_path):
    previous = os.umask(0o022)
    try:
        build_trie(
            [[[1, 2, 3, 1, 2]]], tmp_path / "trie", TrieSettings(order=2, vocab_size=8, tokenizer_hash="x")
        )
    finally:
        os.umask(previous)
    assert (tmp_path / "trie").stat().st_mode & 0o777 == 0o755  # readable by other users of a shared cache


def test_orders_that_do_not_fit_64_bit_keys_are_refused():
    assert check_order(3, 49152) == 16
    assert check_order(4, 65536) == 16
    with pytest.raises(InvalidRequestError, match="--order 3 or less"):
        check_order(4, 151_936)
    with pytest.raises(InvalidRequestError, match="between 1 and"):
        check_order(0, 100)


def test_empty_corpus_is_an_error(tmp_path):
    settings = TrieSettings(order=2, vocab_size=8, tokenizer_hash="x")
    with pytest.raises(InvalidRequestError, match="no tokens"):
        build_trie([[[], []]], tmp_path / "trie", settings)
    assert not (tmp_path / "trie").exists()


def test_out_of_vocabulary_ids_are_an_error(tmp_path):
    settings = TrieSettings(order=2, vocab_size=8, tokenizer_hash="x")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        build_trie([[[1, 9]]], tmp_path / "trie", settings)


def test_target_tokenizer_from_a_model_directory(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "model")
    loaded, name = target_tokenizer(tmp_path / "model")
    assert name == str(tmp_path / "model")
    assert loaded.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(Exception, match="no such model directory"):
        target_tokenizer(tmp_path / "missing")
