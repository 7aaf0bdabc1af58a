"""N-gram trie for DART's continuity-aware tree pruning: build it from a corpus, memory-map it, score
candidate tokens in one lookup per context. See :mod:`diffdraft.ngram.trie` for the on-disk format."""

from diffdraft.ngram.trie import NgramTrie
from diffdraft.util.fingerprint import tokenizer_fingerprint

__all__ = ["NgramTrie", "tokenizer_fingerprint"]
