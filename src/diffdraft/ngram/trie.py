"""An N-gram model stored as a trie of numpy arrays, memory-mapped for DART's tree pruning.

DART scores a candidate draft token ``t`` by ``log(Pr(t | previous N-1 tokens) + eps)``. This
module reads the trie that :mod:`diffdraft.ngram.build` writes and answers that query for a batch
of candidates sharing one context.

On-disk format (a directory, format ``diffdraft-ngram-trie`` version 1)
------------------------------------------------------------------------
``ngram.json``
    ``format``, ``version``, ``order`` (N), ``vocab_size``, ``tokenizer_hash`` (see
    :func:`~diffdraft.util.fingerprint.tokenizer_fingerprint`), ``tokenizer`` (``name``, ``class``),
    ``corpus`` (sources and what was read, dropped and kept), ``token_count`` (corpus tokens = sum of
    unigram counts), ``nodes_per_level`` (list of N ints), ``backoff`` (``rule``, ``alpha``, ``eps``),
    ``min_count`` (pruning of the top level) and ``arrays`` (file name -> dtype, for reading only).
``tokens_{k}.npy``, ``counts_{k}.npy`` for k = 1..N
    One entry per node of level k, i.e. per distinct k-gram kept. Level 1 is the root's children:
    the unigrams. ``tokens_k`` holds the node's last token id (uint16 when the vocabulary fits,
    else uint32), ``counts_k`` how often its k-gram occurs in the corpus (the smallest of uint16,
    uint32, uint64 that holds the largest count). Nodes are sorted by their whole k-gram, so the
    children of one parent are contiguous and sorted by token id.
``offsets_{k}.npy`` for k = 1..N-1
    CSR pointers, ``nodes_per_level[k-1] + 1`` entries: the children of node ``i`` of level k are
    nodes ``offsets_k[i]:offsets_k[i+1]`` of level k+1 (uint32 while level k+1 has fewer than
    2**32 nodes, else int64). ``offsets_k[-1] == nodes_per_level[k]``.

Levels 1..N-1 are complete (every k-gram of the corpus, k < N); level N keeps the N-grams seen at
least ``min_count`` times. Every array is loaded with ``numpy.load(mmap_mode="r")``: pages are read
on demand and shared between processes.

Scores (stupid backoff, Brants et al. 2007)
-------------------------------------------
For a context, only its last N-1 tokens count. The lookup starts at the longest suffix ``h`` of
those tokens that is stored and has children (the empty suffix, the root, always qualifies):
``S(t | h) = c(h t) / c(h)`` when ``h t`` is stored; otherwise ``S(t | h) = alpha * S(t | h[1:])``,
down to the unigram level ``S(t) = c(t) / token_count``. ``alpha`` is 0.4. Contexts shorter than
the starting suffix that were never seen cost nothing: backing off from an unseen context is free,
backing off from a seen one multiplies by ``alpha``. A token never seen at all has ``S = 0``.
The returned score is ``log(S + eps)`` with ``eps = 1e-6`` (as in DART's ``log(Pr + eps)``), so the
floor, for a token absent from the corpus, is ``log(1e-6) = -13.8155``. Stupid-backoff scores are
not normalized probabilities (they may sum to more than 1 over the vocabulary); they rank
continuations, which is all tree pruning needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffdraft.errors import CheckpointError, IncompatibleDrafterError
from diffdraft.util.fingerprint import tokenizer_fingerprint

FORMAT_NAME = "diffdraft-ngram-trie"
FORMAT_VERSION = 1
META_FILE = "ngram.json"
BACKOFF_RULE = "stupid"
ALPHA = 0.4
EPS = 1e-6
CHAIN_CACHE_SIZE = 1 << 16
"""Backoff chains kept in memory (a few hundred bytes each) before the cache starts over."""
REBUILD = "rebuild it with `diffdraft ngram build --target ... --out DIR`"


def tokens_file(level: int) -> str:
    return f"tokens_{level}.npy"


def counts_file(level: int) -> str:
    return f"counts_{level}.npy"


def offsets_file(level: int) -> str:
    return f"offsets_{level}.npy"


def tokenizer_vocab_size(tokenizer) -> int:
    """How many token ids the tokenizer can produce (its base vocabulary plus added tokens)."""
    ids = tokenizer.get_vocab().values()
    return max(len(tokenizer), max(ids, default=-1) + 1)


class NgramTrie:
    """A loaded N-gram trie; see the module docstring for the format and the backoff rule."""

    alpha: float = ALPHA
    eps: float = EPS

    def __init__(self, path: Path, meta: dict, tokens: list, counts: list, offsets: list) -> None:
        self.path = path
        self.meta = meta
        self.order: int = int(meta["order"])
        self.vocab_size: int = int(meta["vocab_size"])
        self.tokenizer_hash: str = str(meta["tokenizer_hash"])
        self.token_count: int = int(meta["token_count"])
        self.nodes_per_level: list[int] = [int(n) for n in meta["nodes_per_level"]]
        backoff = meta.get("backoff", {})
        self.alpha = float(backoff.get("alpha", ALPHA))
        self.eps = float(backoff.get("eps", EPS))
        # Plain ndarray views of the memory maps: slicing a np.memmap subclass costs more per call.
        self._tokens = [np.asarray(a) for a in tokens]
        self._counts = [np.asarray(a) for a in counts]
        self._offsets = [np.asarray(a) for a in offsets]
        self._token_dtype = self._tokens[0].dtype
        self._chains: dict[tuple[int, ...], list[tuple[int, int, int, int]]] = {}
        # Dense root index (token id -> unigram node, -1 if unseen) and unigram scores: the first
        # step of every descent and the last level of every backoff become one array read.
        unigrams = self._tokens[0].astype(np.int64)
        self._root = np.full(self.vocab_size, -1, dtype=np.int64)
        self._root[unigrams] = np.arange(len(unigrams))
        self._unigram = np.zeros(self.vocab_size, dtype=np.float64)
        if self.token_count:
            self._unigram[unigrams] = self._counts[0] / self.token_count

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | os.PathLike) -> NgramTrie:
        """Memory-map a trie directory; a missing, corrupt or inconsistent one raises CheckpointError."""
        path = Path(path).expanduser()
        meta = _read_meta(path)
        order = meta["order"]
        nodes = meta["nodes_per_level"]
        tokens, counts, offsets = [], [], []
        for level in range(1, order + 1):
            tok = _load_array(path, tokens_file(level))
            cnt = _load_array(path, counts_file(level))
            for name, array in ((tokens_file(level), tok), (counts_file(level), cnt)):
                if array.ndim != 1 or array.shape[0] != nodes[level - 1]:
                    _inconsistent(path, f"{name} has shape {array.shape}, expected ({nodes[level - 1]},)")
            tokens.append(tok)
            counts.append(cnt)
            if level < order:
                off = _load_array(path, offsets_file(level))
                if off.ndim != 1 or off.shape[0] != nodes[level - 1] + 1:
                    _inconsistent(
                        path,
                        f"{offsets_file(level)} has shape {off.shape}, expected ({nodes[level - 1] + 1},)",
                    )
                if int(off[0]) != 0 or int(off[-1]) != nodes[level]:
                    _inconsistent(
                        path,
                        f"{offsets_file(level)} spans {int(off[0])}..{int(off[-1])}, "
                        f"expected 0..{nodes[level]}",
                    )
                offsets.append(off)
        if tokens[0].dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            _inconsistent(path, f"{tokens_file(1)} has dtype {tokens[0].dtype}, expected uint16 or uint32")
        for level, array in enumerate(tokens[1:], 2):
            if array.dtype != tokens[0].dtype:
                _inconsistent(
                    path, f"{tokens_file(level)} has dtype {array.dtype}, {tokens_file(1)} {tokens[0].dtype}"
                )
        if len(tokens[0]) and int(tokens[0][-1]) >= meta["vocab_size"]:
            _inconsistent(path, f"{tokens_file(1)} holds token ids beyond vocab_size {meta['vocab_size']}")
        return cls(path, meta, tokens, counts, offsets)

    # ------------------------------------------------------------------ queries

    def log_probs(self, context: Sequence[int], tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """``log(S(t | context) + eps)`` for every candidate ``t`` (float32, candidates' order).

        ``S`` is the stupid-backoff score of the module docstring over the last ``order - 1`` tokens
        of ``context`` (an empty context gives unigram scores). The context is resolved once; all
        candidates are then looked up together among each backoff level's children.
        """
        candidates = np.asarray(tokens, dtype=np.int64).reshape(-1)
        # Negative ids wrap to huge unsigned values, so one comparison finds every id out of range.
        outside = candidates.astype(np.uint64) >= self.vocab_size
        wanted = candidates.astype(self._token_dtype)  # the children's dtype: no per-call array casts
        any_outside = np.count_nonzero(outside)
        if any_outside:
            wanted[outside] = 0
        chain = self._backoff_chain(context)
        # From the root up: a candidate found at a longer context overwrites its shorter-context score,
        # which gives the backoff rule's answer with no per-candidate bookkeeping.
        scores = self._unigram[wanted] * self.alpha ** (len(chain) - 1)
        for depth in range(len(chain) - 2, -1, -1):
            level, lo, hi, denominator = chain[depth]
            children = self._tokens[level][lo:hi]
            where = children.searchsorted(wanted)
            np.minimum(where, hi - lo - 1, out=where)
            hit = children[where] == wanted
            where += lo
            found = self._counts[level][where] * (self.alpha**depth / denominator)
            np.copyto(scores, found, where=hit)
        if any_outside:
            scores[outside] = 0.0
        scores += self.eps
        return np.log(scores).astype(np.float32)

    def log_probs_many(
        self, contexts: Sequence[Sequence[int]], tokens: np.ndarray | Sequence[int]
    ) -> np.ndarray:
        """:meth:`log_probs` of one candidate set after each of several contexts, [contexts, candidates]:
        the same numbers, but every context's candidates are searched for at once (one binary search
        over all of them per trie level), as DART's tree asks for a whole beam per level."""
        candidates = np.asarray(tokens, dtype=np.int64).reshape(-1)
        outside = candidates.astype(np.uint64) >= self.vocab_size
        wanted = np.where(outside, 0, candidates)
        chains = [self._backoff_chain(context) for context in contexts]
        depths = np.array([len(chain) - 1 for chain in chains], dtype=np.float64)
        scores = self._unigram[wanted][None, :] * (self.alpha**depths)[:, None]
        for level in range(1, self.order):  # shorter contexts first: a longer one's hit overwrites
            entries = [
                (row, lo, hi, self.alpha**depth / denominator)
                for row, chain in enumerate(chains)
                for depth, (at, lo, hi, denominator) in enumerate(chain[:-1])
                if at == level
            ]
            if not entries:
                continue
            rows, lo, hi, factors = (np.array(column) for column in zip(*entries, strict=True))
            index = _lower_bound(self._tokens[level], lo, hi, wanted)
            clipped = np.minimum(index, len(self._tokens[level]) - 1)
            hit = (index < hi[:, None]) & (self._tokens[level][clipped] == wanted[None, :])
            found = self._counts[level][clipped] * factors[:, None]
            scores[rows] = np.where(hit, found, scores[rows])
        scores[:, outside] = 0.0
        scores += self.eps
        return np.log(scores).astype(np.float32)

    def children(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every child of the longest stored suffix of ``context`` that has children, sorted by id:
        ``(token ids int64, log(S + eps) float32)``, the scores ``log_probs`` gives those tokens."""
        for level, lo, hi, denominator in self._backoff_chain(context):
            if level == 0:
                ids = self._tokens[0].astype(np.int64)
                return ids, np.log(self._unigram[ids] + self.eps).astype(np.float32)
            ids = self._tokens[level][lo:hi].astype(np.int64)
            scores = self._counts[level][lo:hi] / denominator
            return ids, np.log(scores + self.eps).astype(np.float32)
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)

    def check_tokenizer(self, tokenizer) -> None:
        """Raise IncompatibleDrafterError unless ``tokenizer`` is the one the corpus was tokenized with."""
        fingerprint = tokenizer_fingerprint(tokenizer)
        if fingerprint != self.tokenizer_hash:
            built_with = self.meta.get("tokenizer", {})
            raise IncompatibleDrafterError(
                f"the N-gram trie {self.path} was built with tokenizer {self.tokenizer_hash} "
                f"({built_with.get('name', '?')}, {built_with.get('class', '?')}) but the target's tokenizer "
                f"is {fingerprint} ({getattr(tokenizer, 'name_or_path', '') or '?'}, "
                f"{type(tokenizer).__name__}); rebuild it for this target with "
                "`diffdraft ngram build --target TARGET --source ... --out DIR`"
            )

    def disk_bytes(self) -> int:
        """Bytes of every file in the trie directory."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def __repr__(self) -> str:
        return (
            f"NgramTrie({str(self.path)!r}, order={self.order}, vocab_size={self.vocab_size}, "
            f"nodes_per_level={self.nodes_per_level}, tokenizer_hash={self.tokenizer_hash!r})"
        )

    # ------------------------------------------------------------------ internals

    def _backoff_chain(self, context: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """``(level, lo, hi, c(h))`` from the longest stored suffix ``h`` with children down to
        the root (level 0). Level ``k`` means ``h`` has k tokens; its children are nodes ``lo:hi`` of
        ``self._tokens[k]``.

        Memoized: a DART tree asks for the same few contexts on every beam entry and every round,
        and walking the trie from the root costs more than the lookups that follow."""
        keep = self.order - 1
        history = tuple(int(t) for t in context[max(0, len(context) - keep) :]) if keep else ()
        chain = self._chains.get(history)
        if chain is None:
            if len(self._chains) >= CHAIN_CACHE_SIZE:
                self._chains.clear()
            chain = self._chains[history] = self._walk(history)
        return chain

    def _walk(self, history: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        chain = []
        for start in range(len(history)):
            found = self._find(history[start:])
            if found is None:  # an unseen context: back off to a shorter one at no cost
                continue
            level, node = found
            offsets = self._offsets[level - 1]
            lo, hi = int(offsets[node]), int(offsets[node + 1])
            if hi > lo:
                chain.append((level, lo, hi, int(self._counts[level - 1][node])))
        chain.append((0, 0, self.nodes_per_level[0], self.token_count))
        return chain

    def _find(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        """The node of ``suffix`` as ``(level, index)``, or None when it is not stored."""
        first = suffix[0]
        if not 0 <= first < self.vocab_size:
            return None
        node = int(self._root[first])
        if node < 0:
            return None
        for depth in range(1, len(suffix)):
            token = suffix[depth]
            if not 0 <= token < self.vocab_size:
                return None
            offsets = self._offsets[depth - 1]
            lo, hi = int(offsets[node]), int(offsets[node + 1])
            children = self._tokens[depth][lo:hi]
            where = int(np.searchsorted(children, token))
            if where == len(children) or int(children[where]) != token:
                return None
            node = lo + where
        return len(suffix), node


def _lower_bound(sorted_runs: np.ndarray, lo: np.ndarray, hi: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For every run ``sorted_runs[lo[r]:hi[r]]`` (each sorted) and every ``wanted`` token, the first
    index in the run whose token is not below it: a binary search over all runs and tokens at once."""
    low = np.repeat(lo.astype(np.int64)[:, None], len(wanted), axis=1)
    high = np.repeat(hi.astype(np.int64)[:, None], len(wanted), axis=1)
    last = len(sorted_runs) - 1
    while True:
        open_ = low < high
        if not open_.any():
            return low
        middle = (low + high) // 2
        below = open_ & (sorted_runs[np.minimum(middle, last)] < wanted[None, :])
        low = np.where(below, middle + 1, low)
        high = np.where(open_ & ~below, middle, high)


def _read_meta(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: no such N-gram trie directory; build one with "
            "`diffdraft ngram build --target TARGET --source ... --out DIR` or pass the right path"
        )
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} has no {META_FILE}, so it is not a complete N-gram trie (a build may have been "
            f"interrupted); {REBUILD}"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{meta_path} is unreadable or not JSON ({error}); {REBUILD}") from error
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT_NAME:
        raise CheckpointError(
            f"{meta_path} is not a {FORMAT_NAME} file (format {found!r}); "
            f"pass a directory written by `diffdraft ngram build`, or {REBUILD}"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path} has format version {meta.get('version')!r}, this diffdraft reads version "
            f"{FORMAT_VERSION}; {REBUILD} (or use the diffdraft version that wrote it)"
        )
    try:
        order, vocab = int(meta["order"]), int(meta["vocab_size"])
        nodes = [int(n) for n in meta["nodes_per_level"]]
        int(meta["token_count"])
        str(meta["tokenizer_hash"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{meta_path} lacks a valid field ({error!r}); {REBUILD}") from error
    if order < 1 or vocab < 1 or len(nodes) != order or min(nodes) < 0:
        _inconsistent(path, f"order {order}, vocab_size {vocab} and nodes_per_level {nodes} do not agree")
    meta["nodes_per_level"] = nodes
    return meta


def _load_array(path: Path, name: str) -> np.ndarray:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"{path} is missing {name}, so the N-gram trie is incomplete; {REBUILD}")
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} is corrupt or truncated ({error}); {REBUILD}") from error
    if array.dtype.kind not in "ui":
        _inconsistent(path, f"{name} has dtype {array.dtype}, expected an integer dtype")
    return array


def _inconsistent(path: Path, problem: str) -> None:
    raise CheckpointError(f"{path}: inconsistent N-gram trie: {problem}; {REBUILD}")
