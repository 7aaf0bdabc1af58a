"""``diffdraft`` command line: ``generate`` a request, ``prepare`` what its first run would build,
``train`` drafters, ``bench`` methods side by side,
build and inspect ``ngram`` tries, create and inspect ``deer`` drafters, ``serve`` an OpenAI-compatible
API and put a running server under load (``serve-load``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from diffdraft.bench.cli import add_bench_parser, run_bench
from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.commands.model_options import add_model_arguments, load_generator
from diffdraft.drafters.deer_cli import add_deer_parser, run_deer
from diffdraft.errors import DiffdraftError, InvalidRequestError
from diffdraft.export.cli import add_export_parser, run_export
from diffdraft.ngram.cli import add_ngram_parser, run_ngram
from diffdraft.runtime.sampling import MIN_TEMPERATURE, check_sampling
from diffdraft.serve.cli import add_serve_load_parser, add_serve_parser, run_serve, run_serve_load
from diffdraft.train.cli import add_train_parser, run_train
from diffdraft.util.cache import cache_root


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt or chat")
    add_model_arguments(p)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help=f"0 = greedy (default); else at least {MIN_TEMPERATURE:g}: below it sampling is greedy in "
        "all but name and its float32 scores head for overflow",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 (default) disables it")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text, used as given (no chat template)")
    source.add_argument("--chat", action="store_true", help="read chat messages as JSON from stdin")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and stats")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --json: also each generated token's log-probability under the target and the K "
        "most likely tokens at its position (0-20)",
    )


def _read_messages() -> list[dict]:
    """The --chat messages from stdin. Bytes that are not UTF-8 stop a strict stdin here; under a
    locale that decodes them as surrogates, the messages' own check names them."""
    try:
        raw = sys.stdin.read()
    except UnicodeDecodeError as err:
        raise InvalidRequestError(
            f"--chat reads UTF-8 text from stdin, but byte {err.object[err.start]:#04x} at offset "
            f"{err.start} of what it read is not UTF-8; pass the messages as UTF-8 (e.g. convert them "
            "with iconv -t UTF-8)"
        ) from err
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(
            f"--chat expects a JSON list of messages on stdin, e.g. "
            f'[{{"role": "user", "content": "Hi"}}]; could not parse it: {err}'
        ) from err
    return messages


def _run_generate(args: argparse.Namespace) -> None:
    if args.logprobs is not None and not args.json:
        raise InvalidRequestError("--logprobs goes into the JSON output: add --json")
    check_sampling(args.temperature, args.top_k, args.top_p)  # before the (slow) load
    request = {"messages": _read_messages()} if args.chat else {"prompt": args.prompt}
    generator = load_generator(args)
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        logprobs=args.logprobs,
    )
    result = None
    for chunk in generator.stream(**request, **options):
        if args.stream and not args.json:
            print(chunk.text, end="", flush=True)
        result = chunk.result or result
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        if not args.stream:
            print(result.text)
        else:
            print()
        s = result.stats
        tok_s = len(result.token_ids) / s.total_seconds if s.total_seconds else 0.0
        print(
            f"[{args.method}] {len(result.token_ids)} tokens, {s.rounds} rounds, tau {s.tau:.2f}, "
            f"{tok_s:.1f} tok/s, stop: {s.stop_reason}",
            file=sys.stderr,
        )


def _prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="build now what the first generate or serve would: convert the target, compile the CPU "
        "kernel, time the auto budget's forwards alone and shared (scripts/install.sh runs it for the "
        "default target)",
    )
    add_model_arguments(p)
    p.set_defaults(method="ddtree")


def _run_prepare(args: argparse.Namespace) -> None:
    """Load what ``generate`` with the same options loads, which converts, compiles and probes
    whatever the cache lacks, and time the shared forwards a server's auto budget plans with; then
    say how long it took."""
    begin = time.perf_counter()
    builder = load_generator(args).engine.builder
    if isinstance(builder, AutoBudgetBuilder):
        builder.rounds.prepare_batches()
    print(
        f"diffdraft prepare: {args.target} ({args.method}) ready in {time.perf_counter() - begin:.0f} s; "
        f"the cache under {cache_root()} holds what it built",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser (also what the README's commands are checked against)."""
    parser = argparse.ArgumentParser(prog="diffdraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _prepare_parser(sub)
    add_train_parser(sub)
    add_bench_parser(sub)
    add_ngram_parser(sub)
    add_deer_parser(sub)
    add_export_parser(sub)
    add_serve_parser(sub)
    add_serve_load_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            return run_bench(args)
        if args.command == "ngram":
            return run_ngram(args)
        if args.command == "deer":
            return run_deer(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "serve-load":
            return run_serve_load(args)
        if args.command == "export":
            return run_export(args)
        {"train": run_train, "prepare": _run_prepare}.get(args.command, _run_generate)(args)
    except DiffdraftError as err:
        print(f"diffdraft: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
