"""A Qwen3 DSpark drafter as each engine loads it: vLLM's Hugging Face layout, SGLang's (the same
config, with what its DSpark cannot run refused), and llama.cpp's GGUF tensors and keys.

DSpark is DFlash's network plus a low-rank Markov head that biases each position's logits by the
token chosen before it, an optional reduced vocabulary with its own head, and an optional confidence
head drafting never reads (:mod:`diffdraft.drafters.dspark_model`). What each engine reads, from its
source (read for facts only):

* vLLM 0.32 (``vllm/config/speculative.py``: ``method: "dspark"``, found by the architecture
  ``Qwen3DSparkModel``; ``num_speculative_tokens`` defaults to ``block_size``;
  ``vllm/model_executor/models/qwen3_dspark.py``: ``Qwen3DSparkForCausalLM``;
  ``vllm/v1/worker/gpu/spec_decode/utils.py``: the noise token is ``dflash_config.mask_token_id``,
  else ``mask_token_id``, else ``dspark_noise_token_id``; ``.../spec_decode/eagle/eagle3_utils.py``:
  the taps are top-level ``target_layer_ids`` + 1 when neither ``eagle_aux_hidden_state_layer_ids``,
  ``dflash_config`` nor ``dspark_target_layer_ids`` is set; ``.../spec_decode/dspark/speculator.py``:
  ``sample_from_anchor`` (default true) makes the block ``num_speculative_tokens`` rows, else one
  more): the top-level keys ``markov_rank``, ``draft_vocab_size``, ``logit_scale``,
  ``dspark_draft_topk``, ``enable_confidence_head``, ``confidence_head_with_markov``; the weights
  ``markov_head.markov_w1`` [V, r] / ``markov_head.markov_w2`` [draft V, r],
  ``confidence_head.proj`` (with a bias), ``lm_head`` and ``d2t`` (draft id ``j`` -> target id
  ``j + d2t[j]``; both required for a reduced vocabulary), under the names our network has.
* SGLang (``python/sglang/srt/models/dspark.py``: entry class ``Qwen3DSparkModel``;
  ``python/sglang/srt/speculative/dspark_components/dspark_config.py``: ``markov_rank``,
  ``markov_head_type``, the noise token ``dspark_noise_token_id``, the block ``block_size``, taps from
  ``target_layer_ids``, ``--speculative-num-draft-tokens`` = block + 1): base logits are always the
  target's LM head (``lm_head.*`` weights are skipped, no ``d2t``), unscaled, over every token, each
  block slot predicting the next token (the anchor-first block), and a confidence head is built
  whatever the config says and must be loaded. So refused for SGLang: a head of the drafter's own
  (reduced or whole vocabulary), ``logit_scale`` other than 1, ``dspark_draft_topk``,
  ``sample_from_anchor: false``, and a drafter without a confidence head.
* llama.cpp (``src/models/dflash.cpp``, ``common/speculative.cpp``, ``conversion/qwen.py``'s
  ``DSparkModel``): architecture ``dflash``, ``--spec-type draft-dspark`` (found by the tensor
  ``markov_w1.weight``); keys ``dflash.sample_from_anchor`` and ``dflash.has_confidence_head``
  (bool); tensors ``markov_w1.weight`` [V, r], ``markov_w2.weight`` [draft V, r], ``conf_proj.weight``
  [1, H + r] and ``conf_proj.bias`` (the head with the Markov embedding only: a confidence head
  without it is left out, drafting never reads it), ``output.weight`` for a head of the drafter's own
  (reduced or whole vocabulary: ``load_arch_tensors`` takes it when present) and ``d2t`` as absolute
  target ids (I64). The graph adds the Markov bias to the head's logits unscaled and applies no
  ``logit_scale`` to DSpark's logits: a scale is folded into the drafter's own head and
  ``markov_w2`` (the same distributions), and refused where the head is the target's. It has no
  ``dspark_draft_topk``: refused.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.dspark_model import ARCHITECTURES, DSparkDraftModel
from diffdraft.errors import ExportError
from diffdraft.export.layout import serving_config as dflash_serving_config

ARCHITECTURE = ARCHITECTURES[0]
"""The name vLLM and SGLang both map to their Qwen3 DSpark model."""
STALE_KEYS = ("dflash_config", "mask_token_id", "dspark_target_layer_ids", "dspark_block_size")
"""Keys the engines would read before ours (a ``dflash_config`` or ``mask_token_id`` names the noise
token and the taps first; the ``dspark_*`` copies are DeepSeek-V4's), so none is written."""
HEAD_PREFIXES = ("markov_head.", "confidence_head.", "lm_head.", "d2t")
"""The weights DSpark adds to DFlash's network, which :func:`gguf_tensors` names for llama.cpp."""


def serving_config(model: DSparkDraftModel) -> dict:
    """DFlash's serving config (the backbone both engines build) with DSpark's top-level settings."""
    config = dflash_serving_config(model)
    for key in STALE_KEYS:
        config.pop(key, None)
    source = model.config
    config.update(
        architectures=[ARCHITECTURE],
        block_size=model.block_size,
        target_layer_ids=list(model.target_layer_ids),
        dspark_noise_token_id=model.mask_token_id,
        markov_rank=int(source.markov_rank),
        markov_head_type="vanilla",
        draft_vocab_size=int(model.markov_head.markov_w2.weight.shape[0]),
        sample_from_anchor=model.anchor_rows == 0,
        logit_scale=model.logit_scale,
        enable_confidence_head=has_confidence_head(model),
        confidence_head_with_markov=bool(getattr(source, "confidence_head_with_markov", False)),
    )
    if model.draft_top_k is not None:
        config["dspark_draft_topk"] = int(model.draft_top_k)
    else:
        config.pop("dspark_draft_topk", None)
    return config


def has_confidence_head(model: DSparkDraftModel) -> bool:
    return getattr(model, "confidence_head", None) is not None


def serving_weights(model: DSparkDraftModel) -> dict[str, torch.Tensor]:
    """Every weight under its own name (ours are vLLM's): backbone, Markov and confidence heads, and
    the drafter's own ``lm_head`` and ``d2t`` where it has them."""
    return {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}


def check_sglang(model: DSparkDraftModel) -> None:
    """Refuse what SGLang's DSpark cannot run (module docstring)."""
    problems = []
    if model.lm_head is not None:
        vocab = "a reduced vocabulary" if model.draft_vocab is not None else "the whole vocabulary"
        problems.append(f"a head of its own over {vocab} (SGLang always scores with the target's LM head)")
    if model.logit_scale != 1.0:
        problems.append(f"logit_scale {model.logit_scale} (SGLang does not scale DSpark's logits)")
    if model.draft_top_k is not None:
        problems.append(f"dspark_draft_topk {model.draft_top_k} (SGLang has no top-k Markov path)")
    if model.anchor_rows:
        problems.append("sample_from_anchor false (SGLang's DSpark block has every slot predict)")
    if not has_confidence_head(model):
        problems.append("no confidence head (SGLang builds one for every DSpark drafter and loads it)")
    if problems:
        raise ExportError(
            "this DSpark drafter has " + "; ".join(problems) + ", which SGLang's DSpark cannot run: "
            "export it with --format vllm"
        )


def gguf_metadata(model: DSparkDraftModel, arch: str) -> dict:
    """The GGUF keys DSpark adds to DFlash's; refuses what llama.cpp's DSpark graph does not compute."""
    if model.draft_top_k is not None:
        raise ExportError(
            f"this DSpark drafter sets dspark_draft_topk {model.draft_top_k}, which llama.cpp's DSpark graph "
            "does not run (it biases every logit): export it with --format vllm"
        )
    if model.logit_scale != 1.0 and model.lm_head is None:
        raise ExportError(
            f"this DSpark drafter scales its logits by {model.logit_scale}; llama.cpp's DSpark graph scales "
            "none, and the head is the target's, so the scale cannot be folded into the drafter's "
            "weights: export it with --format vllm"
        )
    return {
        f"{arch}.sample_from_anchor": model.anchor_rows == 0,
        f"{arch}.has_confidence_head": _gguf_confidence_head(model),
    }


def _gguf_confidence_head(model: DSparkDraftModel) -> bool:
    """Whether llama.cpp gets the confidence head: only the kind that reads the Markov embedding."""
    return has_confidence_head(model) and bool(getattr(model.config, "confidence_head_with_markov", False))


def gguf_tensors(model: DSparkDraftModel) -> dict[str, torch.Tensor]:
    """The Markov and confidence heads, the drafter's own head and ``d2t`` under llama.cpp's names,
    a ``logit_scale`` folded into the two weights whose logits it scales."""
    scale = model.logit_scale
    tensors = {
        "markov_w1.weight": model.markov_head.markov_w1.weight,
        "markov_w2.weight": model.markov_head.markov_w2.weight * scale,
    }
    if _gguf_confidence_head(model):
        tensors["conf_proj.weight"] = model.confidence_head.proj.weight
        tensors["conf_proj.bias"] = model.confidence_head.proj.bias
    if model.lm_head is not None:
        tensors["output.weight"] = model.lm_head.weight * scale
    if model.draft_vocab is not None:
        tensors["d2t"] = model.draft_vocab.to(torch.int64)  # absolute target ids, not vLLM's offsets
    return {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
