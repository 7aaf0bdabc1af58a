"""Our DFlash drafter in llama.cpp's own DFlash beside our chain and DDTree, on one target file, one run.

The drafter goes to llama.cpp through `diffdraft export --format llama.cpp`; llama.cpp's
`llama-speculative-simple --spec-type draft-dflash` then drafts with it, greedy. Every prompt is
tokenized once by llama.cpp (`llama-tokenize`, which parses special tokens, as the speculative example
does) and our engine is given those ids, so both engines start from the same tokens. Beside DFlash:
llama.cpp's plain decode (`llama-completion`) against our `ar`, and its n-gram speculation
(`ngram-simple`, `ngram-mod`: defaults and tuned settings) against our `pld`.

Acceptance is counted the same way on both sides: tokens committed per verification round, the
bonus token included (llama.cpp's from its closing statistics). The report compares the mean
acceptance length of llama.cpp's DFlash with our chain's (issue 75's bar: within 5%), then twice more
where the two engines see the same context: over the text both generated alike (their greedy texts
part where their kernels round a close call differently), and token by token in the first round.

    python benchmarks/llamacpp-dflash/run.py --out benchmarks/llamacpp-dflash/results
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("gguf_formats_run", HERE.parent / "gguf-formats" / "run.py")
gguf_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_run)  # its llama.cpp helpers, machine facts and contention-timed steps
log, Step = gguf_run.log, gguf_run.Step

DRAFT_LENGTH = 7
"""Tokens a DFlash round drafts: the shipped drafter's block of 8 less its root, in both engines."""
OUR_METHODS = ["ar", "chain", "ddtree:8", "ddtree:16", "pld"]
"""Our rows: plain decoding, the drafter's chain (what llama.cpp's DFlash drafts), DDTree trees from
the same drafter, and prompt lookup."""
NGRAM_SETTINGS = {
    "ngram-simple": [
        [],
        ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"],
        ["--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "16"],
    ],
    "ngram-mod": [
        [],
        ["--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "8"],
        ["--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16"],
    ],
}
"""llama.cpp's n-gram speculation: its defaults (sized for long agent contexts) and two settings
sized for these prompts; the report takes the fastest of each type as its tuned row."""
STAT_LINES = (
    re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    re.compile(r"n_drafted\s*=\s*(\d+)"),
    re.compile(r"n_accept\s*=\s*(\d+)"),
)
"""The closing statistics of llama.cpp's speculative example: new tokens and decode seconds, draft
tokens proposed, draft tokens accepted."""
ROUND_LINE = re.compile(r"accepted (\d+)/\d+ draft tokens")
"""llama.cpp's debug line for one verification round (``-v``)."""
TOP_DRAFT_LINE = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)")
"""llama.cpp's debug line for a drafted position's top candidate (``-v``)."""


def chat_prompts(tokenizer, humaneval: int, mtbench: int) -> list[dict]:
    """Chat-templated prompt texts: HumanEval requests and MT-Bench first turns, spread over each set."""
    from diffdraft.bench.datasets import load_samples

    samples = load_samples("humaneval", humaneval) + load_samples("mtbench", mtbench)
    return [
        {
            "id": s.id,
            "text": tokenizer.apply_chat_template(s.messages, tokenize=False, add_generation_prompt=True),
        }
        for s in samples
    ]


def llama_token_ids(bin_dir: Path, target: Path, text: str) -> list[int]:
    out = subprocess.run(
        [str(bin_dir / "llama-tokenize"), "-m", str(target), "-p", text, "--no-escape",
         "--ids", "--log-disable"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_speculative(
    bin_dir: Path,
    target: Path,
    text: str,
    tokens: int,
    threads: int,
    spec: list[str],
    per_round: bool = False,
) -> dict:
    """One greedy generation of llama.cpp's speculative example. ``-n tokens - 1``: the example stops
    only once it has passed its limit.

    Its closing lines give the acceptance: every round commits its accepted draft tokens and one token
    of the target's own, so rounds = decoded - accepted. ``per_round`` also reads each round's debug
    line (``-v``) into ``round_lengths`` and the first round's drafted tokens into ``first_draft``;
    printing them doubles the decode time, so such a run is not a timing."""
    cmd = [
        str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-p", text, "--no-escape",
        "-n", str(tokens - 1), "--temp", "0", "-t", str(threads), "-tb", str(threads), "-c", "2048",
        *spec, *(["-v"] if per_round else []),
    ]  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600)
    record = {"rc": out.returncode, "wall_s": round(time.monotonic() - start, 3)}
    both = out.stdout + out.stderr
    if out.returncode != 0:
        return record | {"error": both.strip()[-800:]}
    decoded, drafted, accepted = (pattern.search(both) for pattern in STAT_LINES)
    if decoded is None or drafted is None or accepted is None:
        return record | {"error": "no 'decoded', 'n_drafted' or 'n_accept' line in llama.cpp's output"}
    new_tokens, n_accept = int(decoded.group(1)), int(accepted.group(1))
    record |= {
        "new_tokens": new_tokens,
        "decode_s": float(decoded.group(2)),
        "rounds": new_tokens - n_accept,
        "accepted": n_accept,
        "drafted": int(drafted.group(1)),
        "text": out.stdout,  # the prompt, then the generated text (the end token is not printed)
    }
    if per_round:
        record["round_lengths"] = [int(n) + 1 for n in ROUND_LINE.findall(out.stderr)]
        first_round = out.stderr.split("accepted ", 1)[0]
        record["first_draft"] = [int(token) for _, token in TOP_DRAFT_LINE.findall(first_round)]
        if len(record["round_lengths"]) != record["rounds"]:
            return record | {
                "error": f"{len(record['round_lengths'])} round lines for {record['rounds']} rounds"
            }
    return record


def run_ours(target: Path, methods: list[str], drafter: str, prompts: list[dict], tokens: int) -> dict:
    """Our rows on llama.cpp's prompt ids; each method loads once and warms up on the first prompt."""
    import diffdraft

    rows = {}
    for label in methods:
        name, _, budget = label.partition(":")
        uses_drafter = name in ("chain", "ddtree")
        gen = diffdraft.load(
            target=str(target), method=name, drafter=drafter if uses_drafter else None,
            budget=int(budget) if budget else None,
        )  # fmt: skip
        gen.generate(prompt_token_ids=prompts[0]["ids"], max_new_tokens=16)
        runs = []
        for prompt in prompts:
            result = gen.generate(prompt_token_ids=prompt["ids"], max_new_tokens=tokens)
            stats = result.stats
            decode_s = stats.total_seconds - stats.timings.get("prefill", 0.0)
            runs.append(
                {
                    "id": prompt["id"],
                    "new_tokens": len(result.token_ids),
                    "decode_s": decode_s,
                    "rounds": stats.rounds,
                    "acceptance_lengths": list(stats.acceptance_lengths),
                    "token_ids": list(result.token_ids),
                }
            )
            rate = len(result.token_ids) / decode_s
            log(f"ours {label} {prompt['id']}: tau {stats.tau:.2f}, {rate:.1f} tok/s")
        rows[label] = runs
        del gen
    return rows


def our_first_drafts(dense_target, drafter: str, prompts: list[dict], depth: int) -> list[list[int]]:
    """Our drafter's top tokens for llama.cpp's first round: context = the prompt but its last token,
    which is the block's root (the speculative example keeps it out of the prefill). ``dense_target``:
    the target file loaded in float32 (dequantized weights), the reference both engines' kernels
    approximate."""
    import torch

    from diffdraft.drafters.checkpoint import load_draft_model, resolve_drafter_path
    from diffdraft.drafters.dflash import DFlashDrafter
    from diffdraft.target.model import TargetModel
    from diffdraft.train.features import OnlineFeatures

    target_model = TargetModel(dense_target)
    model = DFlashDrafter(load_draft_model(resolve_drafter_path(drafter)), target_model)
    features = OnlineFeatures(target_model, model.target_layer_ids)
    drafts = []
    for prompt in prompts:
        ids = torch.tensor(prompt["ids"])
        taps, _ = features.with_logits(ids)
        model.reset()
        model.extend_context(taps[:-1], 0)
        drafts.append(model.propose(ids, depth).top(1)[1][:, 0].tolist())
    return drafts


def first_draft_agreement(rows: dict, ours: list[list[int]]) -> dict:
    """How often llama.cpp's DFlash and our drafter draft the same top token in the first round, where
    both see the prompt alone: whether the export carries the drafter over, apart from the rounding of
    the two engines' kernels."""
    same = total = 0
    for run, our_draft in zip(rows["llama.cpp dflash"]["runs"], ours, strict=True):
        theirs = run.get("first_draft", [])
        same += sum(a == b for a, b in zip(theirs, our_draft, strict=False))
        total += min(len(theirs), len(our_draft))
    return {"same": same, "positions": total, "ours": ours}


def shared_prefix(llama_run: dict, prompt_text: str, our_ids: list[int], tokenizer) -> int:
    """How many of our generated tokens llama.cpp generated alike: the longest run of our tokens whose
    text opens llama.cpp's generated text (its output after the prompt; it prints no end token)."""
    printed = llama_run["text"]
    start = printed.find(prompt_text)
    if start < 0:
        return 0
    generated = printed[start + len(prompt_text) :].rstrip("\n")
    shared = 0
    while shared < len(our_ids) and generated.startswith(
        tokenizer.decode(our_ids[: shared + 1]).rstrip("\n")
    ):
        shared += 1
    return shared


def rounds_within(lengths: list[int], tokens: int, first: int) -> tuple[int, int]:
    """(tokens, rounds) of the rounds that commit only tokens before ``tokens``; ``first``: where the
    first round starts (1 for ours, whose prefill samples the first token; 0 for llama.cpp's example,
    whose first round drafts it)."""
    end, rounds = first, 0
    for length in lengths:
        if end + length > tokens:
            break
        end, rounds = end + length, rounds + 1
    return end - first, rounds


def same_text_acceptance(rows: dict, prompts: list[dict], tokenizer) -> dict:
    """Acceptance of llama.cpp's DFlash and our chain on the text both generated alike: the engines'
    greedy outputs part where llama.cpp's Q-format kernels and ours round a close call differently,
    and after that each drafts for its own text. Before it, both draft for the same context."""
    llama_runs = {r["id"]: r for r in rows["llama.cpp dflash"]["runs"]}
    our_runs = {r["id"]: r for r in rows["ours chain"]["runs"]}
    per_prompt, totals = [], {"llama": [0, 0], "ours": [0, 0]}
    for prompt in prompts:
        llama, ours = llama_runs[prompt["id"]], our_runs[prompt["id"]]
        if "error" in llama or "round_lengths" not in llama:
            continue
        ids = ours["token_ids"]
        if ids and ids[-1] == tokenizer.eos_token_id:
            ids = ids[:-1]
        shared = shared_prefix(llama, tokenizer.decode(prompt["ids"]), ids, tokenizer)
        counts = {
            "llama": rounds_within(llama["round_lengths"], shared, 0),
            "ours": rounds_within(ours["acceptance_lengths"], shared, 1),
        }
        for side, (tokens, rounds) in counts.items():
            totals[side][0] += tokens
            totals[side][1] += rounds
        per_prompt.append(
            {
                "id": prompt["id"],
                "shared_tokens": shared,
                "our_tokens": len(ids),
                "identical": shared == len(ids),
            }
            | {f"{side}_tokens_rounds": list(c) for side, c in counts.items()}
        )
    return {
        "prompts": per_prompt,
        "shared_tokens": sum(p["shared_tokens"] for p in per_prompt),
        "our_tokens": sum(p["our_tokens"] for p in per_prompt),
        "identical": sum(p["identical"] for p in per_prompt),
        "llama_acceptance_length": totals["llama"][0] / totals["llama"][1] if totals["llama"][1] else None,
        "our_acceptance_length": totals["ours"][0] / totals["ours"][1] if totals["ours"][1] else None,
    }


def summary(runs: list[dict]) -> dict:
    """Pooled over prompts: acceptance length (tokens committed by verification rounds over rounds, the
    bonus token included; a token our prefill samples is in no round), tokens/s after the prefill, ms
    per round."""
    done = [r for r in runs if "error" not in r]
    committed = sum(sum(r.get("acceptance_lengths", [r["new_tokens"]])) for r in done)
    seconds = sum(r["decode_s"] for r in done)
    tokens = sum(r["new_tokens"] for r in done)
    rounds = sum(r["rounds"] for r in done)
    return {
        "prompts": len(done),
        "failed": len(runs) - len(done),
        "acceptance_length": committed / rounds if rounds else None,
        "tok_s": tokens / seconds if seconds else None,
        "ms_per_round": 1000 * seconds / rounds if rounds else None,
        "new_tokens": tokens,
        "rounds": rounds,
    }


def plain_llama(bin_dir: Path, target: Path, prompts: list[dict], tokens: int, threads: int) -> dict:
    """llama.cpp's plain greedy decode of the same texts (its decode rate; one token a round)."""
    binary = gguf_run.find_completion_binary(bin_dir)
    flags = gguf_run.completion_flags(binary)
    runs = []
    for prompt in prompts:
        r = gguf_run.run_llama_completion(binary, flags, target, prompt["text"], tokens, threads, 2048)
        if "error" in r:
            runs.append({"id": prompt["id"], "error": r["error"]})
            continue
        runs.append(
            {
                "id": prompt["id"], "new_tokens": r["eval_runs"], "decode_s": r["eval_ms"] / 1000,
                "rounds": r["eval_runs"],
            }
        )  # fmt: skip
    return {"runs": runs, "summary": summary(runs)}


def write_report(out: Path, results: dict) -> None:
    rows = results["rows"]
    chain, dflash = rows["ours chain"]["summary"], rows["llama.cpp dflash"]["summary"]
    machine = results["machine"]
    lines = [
        "# Our DFlash drafter in llama.cpp beside our chain and DDTree",
        "",
        f"`{results['command']}`, {machine['date']}, {machine['cpu']} ({machine['cpus']} cores, "
        f"{results['settings']['threads']} threads), llama.cpp {machine['llama_cpp_version']}, diffdraft "
        f"{machine['diffdraft_commit'][:7]}. Target `{results['settings']['target_name']}`; drafter "
        f"`{results['settings']['drafter']}` exported with `diffdraft export --format llama.cpp`. "
        f"{len(results['prompts'])} prompts ({results['settings']['humaneval']} HumanEval, "
        f"{results['settings']['mtbench']} MT-Bench first turns, chat template), at most "
        f"{results['settings']['tokens']} new tokens, greedy, both engines on llama.cpp's prompt ids.",
        "",
        "| engine | method | acceptance length | tok/s | ms/round | rounds | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        s = row["summary"]
        engine, method = label.split(" ", 1)
        failed = f" ({s['failed']} prompts failed)" if s["failed"] else ""
        figures = [_figure(s["acceptance_length"], 3), _figure(s["tok_s"], 1), _figure(s["ms_per_round"], 2)]
        lines.append(
            f"| {engine} | {method}{row.get('setting', '')}{failed} | {' | '.join(figures)} | "
            f"{s['rounds']} | {s['new_tokens']} |"
        )
    same = results["same_text"]
    if dflash["acceptance_length"] and chain["acceptance_length"]:
        gap = dflash["acceptance_length"] / chain["acceptance_length"] - 1
        verdict = (
            f"**llama.cpp's DFlash with our exported drafter: mean acceptance length "
            f"{dflash['acceptance_length']:.3f} against our chain's {chain['acceptance_length']:.3f} "
            f"({gap:+.1%}).**"
        )
    else:
        verdict = "**llama.cpp's DFlash or our chain produced no round: see results.json for the errors.**"
    if same["llama_acceptance_length"] and same["our_acceptance_length"]:
        on_same_text = (
            f"On that shared text alone (the rounds that end inside it) llama.cpp's DFlash commits "
            f"{same['llama_acceptance_length']:.3f} tokens a round and our chain "
            f"{same['our_acceptance_length']:.3f}."
        )
    else:
        on_same_text = "No round of both engines ends inside their shared text."
    first = results["first_draft"]
    lines += [
        "",
        f"{verdict} The engines' greedy texts part where llama.cpp's Q-format kernels and ours round a "
        f"close call differently (identical on {same['identical']} of {len(results['prompts'])} prompts; "
        f"{same['shared_tokens']} of our {same['our_tokens']} tokens lie before the parting), and after "
        f"it each drafts for its own text. {on_same_text} In the first round, where both see the prompt "
        f"alone, llama.cpp's DFlash drafts our drafter's top token (float32 on the file's dequantized "
        f"weights) at {first['same']} of {first['positions']} positions.",
        "",
        "Acceptance length = tokens committed per verification round, the bonus token included, pooled "
        "over all rounds of all prompts. tok/s counts new tokens over the time after the prefill. "
        "llama.cpp's plain row is `llama-completion --ignore-eos` (a decode rate: it does not stop at the "
        "end token, so its token count differs). n-gram rows: every setting tried is in results.json; "
        "the row shown is the fastest.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _figure(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["rows"])
    summaries = [results["rows"][k]["summary"] for k in labels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = ["tab:blue" if k.startswith("ours") else "tab:orange" for k in labels]
    left.barh(labels, [s["acceptance_length"] or 0 for s in summaries], color=colors)
    left.set_xlabel("mean acceptance length (tokens per round)")
    right.barh(labels, [s["tok_s"] or 0 for s in summaries], color=colors)
    right.set_xlabel("tokens/s after the prefill")
    right.set_yticks([])
    for axis in (left, right):
        axis.invert_yaxis()
    fig.suptitle(f"{results['settings']['target_name']}: ours (blue) and llama.cpp (orange), one run")
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--target", default="SHIPPED", help="GGUF file; SHIPPED = the default target's")
    parser.add_argument("--drafter", default="default-dflash", help="a DFlash drafter llama.cpp can run")
    parser.add_argument("--humaneval", type=int, default=6)
    parser.add_argument("--mtbench", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bin", type=Path, default=gguf_run.default_llama_bin())
    args = parser.parse_args()
    args.llama_bin = gguf_run.checked_llama_bin(args.llama_bin)
    import torch

    torch.set_num_threads(args.threads)
    from diffdraft.export import export_drafter
    from diffdraft.target.loading import load_target

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/llamacpp-dflash/run.py " + " ".join(sys.argv[1:])
    target = Path(gguf_run.shipped_gguf() if args.target == "SHIPPED" else args.target).resolve()
    drafter_gguf = out / "drafter.gguf"  # regenerable: git-ignored by the folder's .gitignore
    export_drafter(args.drafter, "llama.cpp", drafter_gguf, force=True, target=target)
    dense = load_target(str(target), dtype="float32")  # the tokenizer, and the first-round reference
    tokenizer = dense.tokenizer
    prompts = chat_prompts(tokenizer, args.humaneval, args.mtbench)
    for prompt in prompts:
        prompt["ids"] = llama_token_ids(args.llama_bin, target, prompt["text"])
    results: dict = {"command": command, "prompts": [{"id": p["id"], "ids": p["ids"]} for p in prompts]}
    results["settings"] = vars(args) | {
        "target_name": target.name,
        "out": str(out),
        "llama_bin": str(args.llama_bin),
    }
    rows: dict = {}
    steps: dict = {}

    def speculative_runs(spec: list[str]) -> list[dict]:
        run = functools.partial(
            run_speculative, args.llama_bin, target, tokens=args.tokens, threads=args.threads
        )
        return [{"id": p["id"]} | run(text=p["text"], spec=spec) for p in prompts]

    with Step(steps, "llama-plain", "llama.cpp plain decode"):
        rows["llama.cpp plain"] = plain_llama(args.llama_bin, target, prompts, args.tokens, args.threads)
    dflash_spec = [
        "-md", str(drafter_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(DRAFT_LENGTH),
    ]  # fmt: skip
    with Step(steps, "llama-dflash", "llama.cpp DFlash"):
        runs = speculative_runs(dflash_spec)
        rows["llama.cpp dflash"] = {"runs": runs, "summary": summary(runs)}
    with Step(steps, "llama-dflash-rounds", "llama.cpp DFlash again, untimed, for its per-round lines"):
        for prompt, run in zip(prompts, runs, strict=True):
            again = run_speculative(
                args.llama_bin, target, prompt["text"], args.tokens, args.threads, dflash_spec, per_round=True
            )
            if "error" not in again and again["text"] == run.get("text"):
                run["round_lengths"], run["first_draft"] = again["round_lengths"], again["first_draft"]
    for kind, settings in NGRAM_SETTINGS.items():
        tried = []
        with Step(steps, f"llama-{kind}", f"llama.cpp {kind}"):
            for setting in settings:
                runs = speculative_runs(["--spec-type", kind, *setting])
                tried.append(
                    {"setting": " ".join(setting) or "defaults", "runs": runs, "summary": summary(runs)}
                )
        best = max(tried, key=lambda t: t["summary"]["tok_s"] or 0)
        rows[f"llama.cpp {kind}"] = {
            "setting": f" ({best['setting']})",
            "summary": best["summary"],
            "tried": tried,
        }
    with Step(steps, "ours", "diffdraft"):
        ours = run_ours(target, OUR_METHODS, args.drafter, prompts, args.tokens)
    for label, runs in ours.items():
        rows[f"ours {label}"] = {"runs": runs, "summary": summary(runs)}

    results["same_text"] = same_text_acceptance(rows, prompts, tokenizer)
    first = our_first_drafts(dense.model, args.drafter, prompts, depth=DRAFT_LENGTH)
    results["first_draft"] = first_draft_agreement(rows, first)
    results["rows"], results["steps"] = rows, steps
    results["machine"] = gguf_run.machine_info(args)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(out, results)
    write_plot(out, results)
    log(f"wrote {out / 'report.md'}")


if __name__ == "__main__":
    main()
