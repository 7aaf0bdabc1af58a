"""The default target's N-gram trie, built once into the cache, is checked on every use: a damaged or
half-written one is named in one line and built again, and the new one scores as a clean one."""

from __future__ import annotations

import random

import numpy as np
import pytest

from diffdraft.ngram import shipped, tokenizer_fingerprint
from diffdraft.ngram.build import TrieSettings, build_trie
from diffdraft.ngram.trie import tokens_file

from diffdraft_testing.checkpoints import tiny_tokenizer

CHECK = "diffdraft: the cached default N-gram trie at {} failed its check ({}); building it again"


@pytest.fixture
def tiny_default(tmp_path, monkeypatch):
    """load_ngram("default") building a trie of random documents over the tiny tokenizer's ids (not a
    minute of ShareGPT) into a private cache; yields (the folder, the builds made)."""
    folder = tmp_path / "ngram-default"
    builds = []

    def build_from_sources(tokenizer, sources, out, order, min_count, force, **options):
        builds.append(force)
        rng = random.Random(0)
        documents = [[rng.randrange(3, 40) for _ in range(30)] for _ in range(20)]
        vocab = len(tokenizer)
        settings = TrieSettings(order, vocab, tokenizer_fingerprint(tokenizer), min_count)
        build_trie([documents], out, settings, force=force)

    monkeypatch.setattr(shipped, "default_ngram_dir", lambda: folder)
    monkeypatch.setattr(shipped, "target_tokenizer", lambda name: (tiny_tokenizer(), "tiny"))
    monkeypatch.setattr(shipped, "build_from_sources", build_from_sources)
    return folder, builds


def _scores(trie) -> np.ndarray:
    return trie.log_probs([5, 7], np.arange(40))


def test_an_intact_trie_is_used_as_built(tiny_default, capsys):
    _, builds = tiny_default
    clean = _scores(shipped.load_ngram("default", tiny_tokenizer(), progress=False))
    capsys.readouterr()
    assert np.array_equal(_scores(shipped.load_ngram("default", tiny_tokenizer(), progress=False)), clean)
    assert len(builds) == 1 and "diffdraft:" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage in an array", "killed before its manifest"])
def test_a_damaged_trie_is_named_and_built_again(tiny_default, capsys, damage):
    folder, builds = tiny_default
    clean = _scores(shipped.load_ngram("default", tiny_tokenizer(), progress=False))
    if damage == "killed before its manifest":
        (folder / "manifest.json").unlink()
        found = "no manifest: its write did not finish, or an older diffdraft wrote it"
    else:
        array = folder / tokens_file(1)
        data = bytearray(array.read_bytes())
        data[-1] ^= 0xFF  # a token id changed: the file still loads
        array.write_bytes(bytes(data))
        found = f"{tokens_file(1)} digest mismatch"
    capsys.readouterr()
    rebuilt = shipped.load_ngram("default", tiny_tokenizer(), progress=False)
    assert CHECK.format(folder, found) in capsys.readouterr().err.splitlines()
    assert np.array_equal(_scores(rebuilt), clean)
    assert builds == [True, True]
