"""``diffdraft ngram``: ``build`` an N-gram trie for a target's tokenizer from a corpus, ``info`` on one."""

from __future__ import annotations

import argparse

from diffdraft.ngram.build import (
    DEFAULT_CHUNK_CHARS,
    DEFAULT_MIN_COUNT,
    DEFAULT_ORDER,
    DEFAULT_SPILL_ENTRIES,
    build_from_sources,
    target_tokenizer,
)
from diffdraft.ngram.trie import NgramTrie


def add_ngram_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("ngram", help="build or inspect the N-gram trie DART's tree pruning uses")
    commands = parser.add_subparsers(dest="ngram_command", required=True)

    build = commands.add_parser("build", help="count a corpus' n-grams into a trie directory")
    build.add_argument(
        "--target",
        required=True,
        help="model directory, .gguf file or 'default': only its tokenizer is loaded",
    )
    build.add_argument(
        "--source",
        action="extend",
        nargs="+",
        required=True,
        metavar="SRC",
        help="'sharegpt' (built in), a jsonl or JSON array file, or a datasets directory (repeatable)",
    )
    build.add_argument("--order", type=int, default=DEFAULT_ORDER, help=f"N (default: {DEFAULT_ORDER})")
    build.add_argument("--out", required=True, help="trie directory to write")
    build.add_argument(
        "--min-count",
        type=int,
        default=DEFAULT_MIN_COUNT,
        help="drop top-order n-grams seen fewer times; lower orders stay complete "
        f"(default: {DEFAULT_MIN_COUNT})",
    )
    build.add_argument(
        "--no-decontaminate",
        dest="decontaminate",
        action="store_false",
        help="keep records sharing a 13-gram with HumanEval, MT-Bench or the bench's ShareGPT slice "
        "(by default they are dropped, as for training data)",
    )
    build.add_argument("--force", action="store_true", help="replace whatever --out holds")
    build.add_argument(
        "--chunk-chars",
        type=int,
        default=DEFAULT_CHUNK_CHARS,
        help=f"characters tokenized and counted at once (default: {DEFAULT_CHUNK_CHARS})",
    )
    build.add_argument(
        "--spill-entries",
        type=int,
        default=DEFAULT_SPILL_ENTRIES,
        help="distinct n-grams per order kept in memory before spilling to disk "
        f"(default: {DEFAULT_SPILL_ENTRIES}; about 16 bytes each)",
    )
    build.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    info = commands.add_parser("info", help="print a trie's order, vocabulary, tokenizer, sizes")
    info.add_argument("trie", help="trie directory")
    return parser


def run_ngram(args: argparse.Namespace) -> int:
    if args.ngram_command == "build":
        _run_build(args)
    else:
        _run_info(args)
    return 0


def _run_build(args: argparse.Namespace) -> None:
    tokenizer, name = target_tokenizer(args.target)
    report = build_from_sources(
        tokenizer,
        args.source,
        args.out,
        order=args.order,
        min_count=args.min_count,
        decontaminate=args.decontaminate,
        force=args.force,
        tokenizer_name=name,
        chunk_chars=args.chunk_chars,
        spill_entries=args.spill_entries,
        progress=args.progress,
    )
    for line in report.lines():
        print(line, flush=True)


def _run_info(args: argparse.Namespace) -> None:
    trie = NgramTrie.load(args.trie)
    meta = trie.meta
    tokenizer = meta.get("tokenizer", {})
    corpus = meta.get("corpus", {})
    backoff = meta.get("backoff", {})
    print(f"trie: {trie.path}")
    print(f"order: {trie.order}")
    print(f"vocab size: {trie.vocab_size}")
    print(f"tokenizer: {trie.tokenizer_hash} ({tokenizer.get('name', '?')}, {tokenizer.get('class', '?')})")
    print(f"corpus: {', '.join(corpus.get('sources', []))}; {corpus.get('documents', '?')} documents")
    print(f"tokens: {trie.token_count}")
    print(f"nodes per level: {', '.join(str(n) for n in trie.nodes_per_level)}")
    print(f"min count (level {trie.order}): {meta.get('min_count')}")
    print(f"backoff: {backoff.get('rule')}, alpha {trie.alpha}, eps {trie.eps}")
    print(f"bytes on disk: {trie.disk_bytes()}")
