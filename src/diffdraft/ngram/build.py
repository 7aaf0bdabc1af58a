"""Count a corpus' N-grams in bounded memory and write them as an :class:`NgramTrie` directory.

The corpus streams through in chunks. For each chunk every n-gram of orders 1..N that lies inside
one document becomes one integer: its token ids packed ``bits`` bits each into a uint64, first
token highest, so sorting the integers sorts the n-grams lexicographically, which is exactly the
order the trie stores its nodes in. Each chunk is reduced to sorted ``(key, count)`` runs with
numpy; runs held in memory are merged (counts summed) when they grow past ``spill_entries`` per
order, and spilled to temporary ``.npy`` files when the merged run is still large. At the end the
spilled runs are merged k-way, ``merge_block`` keys per run at a time, into the final sorted
counts, from which the trie's levels are written block by block. No step holds a Python object per
n-gram, and memory stays around ``spill_entries`` keys per order plus the block buffers.

The trie is written into a temporary directory beside ``--out`` and renamed into place at the end,
so an interrupted build never leaves a half trie under the requested name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from diffdraft.errors import CheckpointError, InvalidRequestError
from diffdraft.ngram.trie import (
    ALPHA,
    BACKOFF_RULE,
    EPS,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    NgramTrie,
    counts_file,
    offsets_file,
    tokenizer_vocab_size,
    tokens_file,
)
from diffdraft.util.cache_digest import sealed_directory
from diffdraft.util.fingerprint import tokenizer_fingerprint
from diffdraft.util.progress import progress_bar

DEFAULT_ORDER = 3
DEFAULT_MIN_COUNT = 2
DEFAULT_CHUNK_CHARS = 4_000_000
"""Characters of text tokenized and counted together (about a million tokens)."""
DEFAULT_SPILL_ENTRIES = 4_000_000
"""Distinct n-grams per order held in memory before their merged run is spilled to disk."""
DEFAULT_MERGE_BLOCK = 1_000_000
"""Keys read from each run per step of the final k-way merge and of writing the levels."""
DECONTAMINATION_NGRAM = 13
MAX_ORDER = 8
_STALE_SECONDS = 24 * 3600
_COUNT_DTYPES = (np.uint16, np.uint32, np.uint64)


def key_bits(vocab_size: int) -> int:
    """Bits per token id in a packed n-gram key."""
    return max(1, (vocab_size - 1).bit_length())


def check_order(order: int, vocab_size: int) -> int:
    """The bits per token for ``order``-grams over this vocabulary; refuse orders that do not fit 64 bits."""
    bits = key_bits(vocab_size)
    if not 1 <= order <= MAX_ORDER:
        raise InvalidRequestError(f"--order must be between 1 and {MAX_ORDER}, got {order} (DART uses 3)")
    if order * bits > 64:
        raise InvalidRequestError(
            f"--order {order} does not fit: a vocabulary of {vocab_size} tokens needs {bits} bits per token "
            f"and {order * bits} bits per {order}-gram, but keys are 64-bit; use --order {64 // bits} or less"
        )
    return bits


# ---------------------------------------------------------------------------------------- counting


def pack_ngrams(ids: np.ndarray, doc_ends: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Packed keys of every n-gram inside one document; ``doc_ends[p]`` is the end of p's document."""
    starts = np.flatnonzero(np.arange(len(ids)) + n <= doc_ends)
    keys = ids[starts].astype(np.uint64)
    shift = np.uint64(bits)
    for j in range(1, n):
        keys = (keys << shift) | ids[starts + j].astype(np.uint64)
    return keys


def reduce_sorted(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the counts of equal neighbours in sorted ``keys``."""
    if len(keys) == 0:
        return keys, counts
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return keys[starts], np.add.reduceat(counts, starts)


def merge_runs(runs: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One sorted run from several, counts of equal keys summed (a stable sort finds the runs)."""
    if len(runs) == 1:
        return runs[0]
    keys = np.concatenate([k for k, _ in runs])
    counts = np.concatenate([c for _, c in runs])
    order = np.argsort(keys, kind="stable")
    return reduce_sorted(keys[order], counts[order])


class _Runs:
    """Sorted (key, count) runs of one order: some in memory, the large ones spilled to disk."""

    def __init__(self, name: str, workdir: Path, spill_entries: int, merge_block: int) -> None:
        self.name, self.workdir = name, workdir
        self.spill_entries, self.merge_block = spill_entries, merge_block
        self.memory: list[tuple[np.ndarray, np.ndarray]] = []
        self.in_memory = 0
        self.spilled: list[tuple[Path, Path]] = []

    def add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.memory.append((keys, counts))
        self.in_memory += len(keys)
        if self.in_memory > self.spill_entries:
            merged = merge_runs(self.memory)
            self.memory, self.in_memory = [merged], len(merged[0])
            if self.in_memory > self.spill_entries // 2:
                self._spill(merged)
                self.memory, self.in_memory = [], 0

    def _spill(self, run: tuple[np.ndarray, np.ndarray]) -> None:
        index = len(self.spilled)
        paths = (
            self.workdir / f"{self.name}-run{index}-keys.npy",
            self.workdir / f"{self.name}-run{index}-counts.npy",
        )
        np.save(paths[0], run[0])
        np.save(paths[1], run[1])
        self.spilled.append(paths)

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """All counts as one sorted run: in memory when nothing spilled, else memory-mapped files."""
        merged = merge_runs(self.memory) if self.memory else _empty_run()
        self.memory = []
        if not self.spilled:
            return merged
        if len(merged[0]):
            self._spill(merged)
        runs = [(_load(k), _load(c)) for k, c in self.spilled]
        out = (self.workdir / f"{self.name}-keys.bin", self.workdir / f"{self.name}-counts.bin")
        total = 0
        with out[0].open("wb") as key_file, out[1].open("wb") as count_file:
            for keys, counts in _kway_merge(runs, self.merge_block):
                key_file.write(keys.tobytes())
                count_file.write(counts.tobytes())
                total += len(keys)
        for paths in self.spilled:
            for path in paths:
                path.unlink()
        if total == 0:
            return _empty_run()
        return (
            np.memmap(out[0], dtype=np.uint64, mode="r", shape=(total,)),
            np.memmap(out[1], dtype=np.int64, mode="r", shape=(total,)),
        )


def _kway_merge(
    runs: list[tuple[np.ndarray, np.ndarray]], block: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Merge sorted runs into sorted, reduced blocks, reading at most ``block`` keys per run per step.

    Each step ends at the smallest ``block``-th key ahead of any run's cursor and takes every key up
    to it (inclusive) from every run, so no key is split across steps.
    """
    cursors = [0] * len(runs)
    while any(c < len(k) for c, (k, _) in zip(cursors, runs, strict=True)):
        boundary = None
        for cursor, (keys, _) in zip(cursors, runs, strict=True):
            if len(keys) - cursor > block:
                last = keys[cursor + block - 1]
                boundary = last if boundary is None else min(boundary, last)
        pieces = []
        for index, (keys, counts) in enumerate(runs):
            cursor = cursors[index]
            if boundary is None:
                end = len(keys)
            else:
                end = cursor + int(np.searchsorted(keys[cursor:], boundary, side="right"))
            if end > cursor:
                pieces.append((np.asarray(keys[cursor:end]), np.asarray(counts[cursor:end])))
            cursors[index] = end
        yield merge_runs(pieces)


class NgramCounter:
    """Counts of every n-gram of orders 1..N in the documents added, in bounded memory."""

    def __init__(
        self,
        order: int,
        vocab_size: int,
        workdir: str | os.PathLike,
        spill_entries: int = DEFAULT_SPILL_ENTRIES,
        merge_block: int = DEFAULT_MERGE_BLOCK,
    ) -> None:
        if spill_entries < 2 or merge_block < 1:
            raise InvalidRequestError("spill_entries must be at least 2 and merge_block at least 1")
        self.order, self.vocab_size = order, vocab_size
        self.bits = check_order(order, vocab_size)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.runs = [
            _Runs(f"order{n}", self.workdir, spill_entries, merge_block) for n in range(1, order + 1)
        ]
        self.tokens = 0
        self.documents = 0

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        """Count the n-grams of a chunk of documents (n-grams never cross a document's end)."""
        lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
        total = int(lengths.sum())
        self.documents += int((lengths > 0).sum())
        if total == 0:
            return
        ids = np.fromiter((t for d in documents for t in d), dtype=np.int64, count=total)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidRequestError(
                f"token id {int(ids.min() if ids.min() < 0 else ids.max())} is outside the vocabulary of "
                f"{self.vocab_size}; the tokenizer and vocab_size do not agree"
            )
        doc_ends = np.repeat(np.cumsum(lengths), lengths)
        self.tokens += total
        for n, runs in enumerate(self.runs, 1):
            keys, counts = np.unique(pack_ngrams(ids, doc_ends, n, self.bits), return_counts=True)
            runs.add(keys, counts.astype(np.int64))

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per order 1..N: sorted packed keys (uint64) and their counts (int64)."""
        return [runs.finish() for runs in self.runs]


def _empty_run() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)


def _load(path: Path) -> np.ndarray:
    array = np.load(path, mmap_mode="r")
    return np.asarray(array)


# ---------------------------------------------------------------------------------------- writing


def _blocks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def _new_array(path: Path, dtype, length: int) -> np.ndarray:
    """A writable .npy of ``length`` entries (memory-mapped unless empty, which cannot be mapped)."""
    if length == 0:
        np.save(path, np.zeros(0, dtype=dtype))
        return np.zeros(0, dtype=dtype)
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(length,))


def _prune(keys: np.ndarray, counts: np.ndarray, min_count: int, workdir: Path, block: int):
    """Keep the keys counted at least ``min_count`` times (two passes, block by block)."""
    kept = sum(int((counts[s] >= min_count).sum()) for s in _blocks(len(keys), block))
    if kept == len(keys):
        return keys, counts
    out_keys = _new_array(workdir / "pruned-keys.npy", np.uint64, kept)
    out_counts = _new_array(workdir / "pruned-counts.npy", np.int64, kept)
    position = 0
    for s in _blocks(len(keys), block):
        mask = np.asarray(counts[s]) >= min_count
        n = int(mask.sum())
        out_keys[position : position + n] = np.asarray(keys[s])[mask]
        out_counts[position : position + n] = np.asarray(counts[s])[mask]
        position += n
    return out_keys, out_counts


def write_levels(
    levels: list[tuple[np.ndarray, np.ndarray]],
    out_dir: Path,
    vocab_size: int,
    min_count: int,
    workdir: Path,
    block: int = DEFAULT_MERGE_BLOCK,
) -> tuple[list[int], dict[str, str]]:
    """Write ``tokens_k``, ``counts_k``, ``offsets_k`` from per-order sorted counts; prune the top level.

    Returns the nodes per level and each file's dtype.
    """
    order = len(levels)
    bits = key_bits(vocab_size)
    levels = list(levels)
    if min_count > 1:
        levels[-1] = _prune(*levels[-1], min_count, workdir, block)
    mask = np.uint64((1 << bits) - 1)
    shift = np.uint64(bits)
    token_dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    dtypes: dict[str, str] = {}
    nodes = [len(keys) for keys, _ in levels]
    for level, (keys, counts) in enumerate(levels, 1):
        n = nodes[level - 1]
        largest = max((int(np.asarray(counts[s]).max()) for s in _blocks(n, block)), default=0)
        count_dtype = next(d for d in _COUNT_DTYPES if largest <= np.iinfo(d).max)
        tokens = _new_array(out_dir / tokens_file(level), token_dtype, n)
        counted = _new_array(out_dir / counts_file(level), count_dtype, n)
        for s in _blocks(n, block):
            tokens[s] = (np.asarray(keys[s]) & mask).astype(token_dtype)
            counted[s] = np.asarray(counts[s]).astype(count_dtype)
        dtypes[tokens_file(level)] = np.dtype(token_dtype).name
        dtypes[counts_file(level)] = np.dtype(count_dtype).name
        _flush(tokens, counted)
        if level < order:
            children = np.asarray(levels[level][0])
            offset_dtype = np.uint32 if nodes[level] < 1 << 32 else np.int64
            offsets = _new_array(out_dir / offsets_file(level), offset_dtype, n + 1)
            for s in _blocks(n, block):
                first_child = np.asarray(keys[s]) << shift
                offsets[s] = np.searchsorted(children, first_child).astype(offset_dtype)
            offsets[n] = nodes[level]
            dtypes[offsets_file(level)] = np.dtype(offset_dtype).name
            _flush(offsets)
    return nodes, dtypes


def _flush(*arrays: np.ndarray) -> None:
    for array in arrays:
        if isinstance(array, np.memmap):
            array.flush()


# ---------------------------------------------------------------------------------------- building


@dataclass
class TrieSettings:
    """What makes two tries the same: rebuilding with equal settings may replace an existing trie."""

    order: int
    vocab_size: int
    tokenizer_hash: str
    min_count: int = DEFAULT_MIN_COUNT
    sources: list[str] = field(default_factory=list)
    decontaminated: bool = False

    def differences(self, meta: dict) -> list[str]:
        corpus = meta.get("corpus", {})
        theirs = {
            "order": meta.get("order"),
            "vocab_size": meta.get("vocab_size"),
            "tokenizer_hash": meta.get("tokenizer_hash"),
            "min_count": meta.get("min_count"),
            "sources": corpus.get("sources"),
            "decontaminated": corpus.get("decontaminated"),
        }
        ours = {key: getattr(self, key) for key in theirs}
        return [f"{key} {theirs[key]!r} (now {ours[key]!r})" for key in theirs if theirs[key] != ours[key]]


def check_out_dir(out: Path, settings: TrieSettings, force: bool) -> None:
    """Refuse to replace anything but nothing, an empty directory or a trie of the same settings."""
    if not out.exists():
        return
    if not out.is_dir():
        raise InvalidRequestError(f"--out {out} is a file; pass a directory path for the trie")
    if force or not any(out.iterdir()):
        return
    try:
        existing = NgramTrie.load(out)
    except CheckpointError as error:
        raise InvalidRequestError(
            f"--out {out} is not empty and is not a complete N-gram trie ({error}); choose another --out, "
            "or pass --force to replace its contents"
        ) from error
    differences = settings.differences(existing.meta)
    if differences:
        raise InvalidRequestError(
            f"--out {out} holds a trie built with other settings ({'; '.join(differences)}); choose another "
            "--out, or pass --force to replace it"
        )


def build_trie(
    batches: Iterable[Sequence[Sequence[int]]],
    out: str | os.PathLike,
    settings: TrieSettings,
    describe: dict | Callable[[], dict] | None = None,
    force: bool = False,
    spill_entries: int = DEFAULT_SPILL_ENTRIES,
    merge_block: int = DEFAULT_MERGE_BLOCK,
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Count the documents of every batch and write the trie to ``out`` atomically, with its digests
    (:func:`diffdraft.util.cache_digest.sealed_directory`); returns its metadata.

    ``batches`` yields lists of documents, each a list of token ids. ``describe`` (a dict, or a
    function called once the batches are exhausted) adds fields to the metadata, its ``tokenizer``
    and ``corpus`` entries merged into those; ``on_batch`` is told each batch's token count.
    """
    out = Path(out).expanduser()
    check_order(settings.order, settings.vocab_size)
    if settings.min_count < 1:
        raise InvalidRequestError(f"--min-count must be at least 1, got {settings.min_count}")
    check_out_dir(out, settings, force)
    _remove_stale(out)
    with sealed_directory(out) as tmp:
        workdir = tmp / ".work"
        counter = NgramCounter(settings.order, settings.vocab_size, workdir, spill_entries, merge_block)
        for documents in batches:
            before = counter.tokens
            counter.add_documents(documents)
            if on_batch is not None:
                on_batch(counter.tokens - before)
        if counter.tokens == 0:
            raise InvalidRequestError("the corpus has no tokens; pass sources with text in them")
        levels = counter.finish()
        nodes, dtypes = write_levels(
            levels, tmp, settings.vocab_size, settings.min_count, workdir, merge_block
        )
        del levels
        shutil.rmtree(workdir)
        describe = dict((describe() if callable(describe) else describe) or {})
        corpus = {"sources": settings.sources, "decontaminated": settings.decontaminated}
        corpus.update(describe.pop("corpus", {}))
        corpus["documents"] = counter.documents
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "order": settings.order,
            "vocab_size": settings.vocab_size,
            "tokenizer_hash": settings.tokenizer_hash,
            "tokenizer": describe.pop("tokenizer", {}),
            "corpus": corpus,
            "token_count": counter.tokens,
            "nodes_per_level": nodes,
            "backoff": {"rule": BACKOFF_RULE, "alpha": ALPHA, "eps": EPS},
            "min_count": settings.min_count,
            "min_count_applies_to": f"level {settings.order} only; levels below are complete",
            "key_bits": key_bits(settings.vocab_size),
            "arrays": dtypes,
            **describe,
        }
        # ngram.json last: a directory without it is never taken for a complete trie.
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def _remove_stale(out: Path) -> None:
    """Temp dirs of builds killed long ago (a live build renames or removes its own)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------- from sources


@dataclass
class BuildReport:
    """What a build read, dropped and wrote."""

    out: Path
    sources: list[str] = field(default_factory=list)
    prompts: int = 0
    duplicates: int = 0
    held_out: int = 0
    contaminated: int = 0
    documents: int = 0
    tokens: int = 0
    nodes_per_level: list[int] = field(default_factory=list)
    disk_bytes: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        kept = self.prompts - self.duplicates - self.held_out - self.contaminated
        return [
            *self.sources,
            f"read {self.prompts} records; dropped {self.duplicates} duplicates, {self.held_out} of the "
            f"bench's ShareGPT slice, {self.contaminated} sharing a {DECONTAMINATION_NGRAM}-gram with "
            f"HumanEval, MT-Bench or that slice; kept {kept}",
            f"counted {self.tokens} tokens in {self.documents} documents (messages and replies)",
            f"wrote {self.out}: nodes per level {self.nodes_per_level}, {self.disk_bytes / 1e6:.1f} MB, "
            f"in {self.seconds:.1f} s",
        ]


def target_tokenizer(target: str | os.PathLike):
    """The tokenizer of ``default``, a Hugging Face directory or a .gguf file, without loading weights.

    Returns ``(tokenizer, name)``. The default target's tokenizer is read from its GGUF file, which
    gives the same vocabulary and added tokens as the converted cache that ``load_target`` uses.
    """
    from diffdraft.target.default_model import MODEL_NAME, default_gguf_path
    from diffdraft.target.loading import _load_tokenizer

    if str(target) == "default":
        gguf = default_gguf_path()
        return _load_tokenizer(gguf.parent, gguf_file=gguf.name), f"default ({MODEL_NAME})"
    path = Path(target).expanduser()
    if path.is_dir():
        return _load_tokenizer(path), str(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_tokenizer(path.parent, gguf_file=path.name), str(path)
    raise CheckpointError(
        f"--target {target}: no such model directory or .gguf file; pass 'default', a local Hugging Face "
        "model directory (with its tokenizer files) or a .gguf file"
    )


def corpus_documents(
    sources: Sequence[str], report: BuildReport, decontaminate: bool = True
) -> Iterator[str]:
    """Every message's content and every reply of the sources' records, cleaned like training data:
    exact duplicates dropped, the bench's ShareGPT slice and anything sharing a 13-gram with HumanEval,
    MT-Bench or that slice left out (as ``diffdraft train prompts --decontaminate`` does)."""
    from diffdraft.data.prompts import ReadReport, read_source, word_ngrams

    banned: set[tuple[str, ...]] = set()
    held_out_ids: set[str] = set()
    if decontaminate:
        from diffdraft.data.prompts import eval_texts
        from diffdraft.data.samples import sharegpt_held_out

        held_out = sharegpt_held_out()
        held_out_ids = {sample.id for sample in held_out}
        texts = eval_texts() + [m["content"] for sample in held_out for m in sample.messages]
        for text in texts:
            banned |= word_ngrams(text, DECONTAMINATION_NGRAM)
    seen: set[bytes] = set()
    for source in sources:
        read = ReadReport(source)
        for prompt in read_source(source, read):
            report.prompts += 1
            texts = [m["content"] for m in prompt.messages] + ([prompt.reply] if prompt.reply else [])
            digest = hashlib.blake2b("\x00".join(texts).encode("utf-8"), digest_size=12).digest()
            if digest in seen:
                report.duplicates += 1
                continue
            seen.add(digest)
            if prompt.id in held_out_ids:
                report.held_out += 1
                continue
            if banned and not banned.isdisjoint(word_ngrams("\n".join(texts), DECONTAMINATION_NGRAM)):
                report.contaminated += 1
                continue
            yield from (text for text in texts if text)
        report.sources.append(read.summary())


def _chunks(texts: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def build_from_sources(
    tokenizer,
    sources: Sequence[str],
    out: str | os.PathLike,
    order: int = DEFAULT_ORDER,
    min_count: int = DEFAULT_MIN_COUNT,
    decontaminate: bool = True,
    force: bool = False,
    tokenizer_name: str | None = None,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    spill_entries: int = DEFAULT_SPILL_ENTRIES,
    merge_block: int = DEFAULT_MERGE_BLOCK,
    progress: bool = True,
) -> BuildReport:
    """Tokenize the sources' text (no chat template, no special tokens) and build the trie at ``out``."""
    started = time.perf_counter()
    if not sources:
        raise InvalidRequestError(
            "pass at least one --source (sharegpt, a jsonl file or a datasets directory)"
        )
    if chunk_chars < 1:
        raise InvalidRequestError(f"chunk_chars must be positive, got {chunk_chars}")
    out = Path(out).expanduser()
    report = BuildReport(out)
    settings = TrieSettings(
        order=order,
        vocab_size=tokenizer_vocab_size(tokenizer),
        tokenizer_hash=tokenizer_fingerprint(tokenizer),
        min_count=min_count,
        sources=list(sources),
        decontaminated=decontaminate,
    )
    # Fail on bad settings or a protected --out before reading the corpus, not after.
    check_order(order, settings.vocab_size)
    check_out_dir(out, settings, force)

    def batches() -> Iterator[list[list[int]]]:
        for chunk in _chunks(corpus_documents(sources, report, decontaminate), chunk_chars):
            yield tokenizer(chunk, add_special_tokens=False)["input_ids"]

    bar = progress_bar(desc="counting n-grams", unit="tok", unit_scale=True, disable=not progress)
    try:
        meta = build_trie(
            batches(),
            out,
            settings,
            describe=lambda: {
                "tokenizer": {
                    "name": tokenizer_name or getattr(tokenizer, "name_or_path", ""),
                    "class": type(tokenizer).__name__,
                },
                "corpus": {
                    "records": report.prompts,
                    "duplicates_dropped": report.duplicates,
                    "held_out_dropped": report.held_out,
                    "contaminated_dropped": report.contaminated,
                    "decontamination_ngram": DECONTAMINATION_NGRAM if decontaminate else None,
                    "text": "every message's content and the reply of each record, tokenized without "
                    "chat template or special tokens; one document each",
                },
            },
            force=force,
            spill_entries=spill_entries,
            merge_block=merge_block,
            on_batch=bar.update,
        )
    finally:
        bar.close()
    report.documents = meta["corpus"]["documents"]
    report.tokens = meta["token_count"]
    report.nodes_per_level = meta["nodes_per_level"]
    report.disk_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    report.seconds = time.perf_counter() - started
    return report
