"""A DFlash2 drafter as each engine loads it: vLLM's Hugging Face layout, llama.cpp's GGUF tensors and
keys, and SGLang's refusal.

DFlash2 is DFlash's network plus a block convolution around each layer's attention and MLP and a
candidate selector over the head's top-K tokens (:mod:`diffdraft.drafters.dflash2_model`). What each
engine reads, from its source (read for facts only):

* vLLM 0.32 (``vllm/model_executor/models/registry.py``: ``DFlash2DraftModel`` ->
  ``qwen3_dflash2.DFlash2Qwen3ForCausalLM``; ``vllm/v1/worker/gpu/spec_decode/__init__.py`` picks
  its speculator by that architecture under ``method: "dflash"``): DFlash's layout (see
  :mod:`diffdraft.export.layout`) with ``dflash_config.{conv_kernel_size, conv_group_size,
  selector_rank, selector_top_k}`` and the optional ``input_embedding_scale``,
  ``output_multiplier``, ``final_logit_softcapping``; the weights ``layers.{i}.attention_conv.*``,
  ``layers.{i}.mlp_conv.*`` (``base_kernel`` [2, taps, H], ``kernel_projection``) and
  ``candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection}``, under the
  names our network has. The convs' block is ``1 + num_speculative_tokens`` rows
  (``DFlash2Qwen3DecoderLayer``), so the launch asks for ``block_size - 1`` tokens.
* llama.cpp (``src/models/dflash.cpp``, ``src/llama-arch.cpp``, ``conversion/qwen.py``'s
  ``DFlashModel`` of llama-cpp-python 0.3.36's vendored tree): architecture ``dflash``; the keys
  ``dflash.conv_kernel_size``, ``dflash.conv_group_size``, ``dflash.selector_rank``,
  ``dflash.selector_top_k`` (uint32), ``dflash.logit_scale`` (our ``output_multiplier``),
  ``dflash.final_logit_softcapping``, ``dflash.embedding_scale`` (float32); the tensors
  ``blk.N.attn_conv_base`` / ``blk.N.ffn_conv_base`` (no ``.weight`` suffix), ``blk.N.attn_conv_proj
  .weight`` / ``blk.N.ffn_conv_proj.weight``, ``selector_predecessor.weight``,
  ``selector_successor.weight``, ``selector_hidden.weight``, in our shapes (ggml lists them reversed).
  ``load_arch_tensors`` refuses a hidden size below ``top_k * (top_k + 1)`` (the selector lattice
  is packed into one hidden-size row), refused here first.
* SGLang has no DFlash2 model: its registry maps no ``DFlash2DraftModel`` (``python/sglang/srt/
  models/`` has ``dflash.py`` and ``dspark.py`` only), and its DFlash model would skip the conv and
  selector weights it does not know, drafting other tokens without a word; refused.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.dflash2_model import ARCHITECTURE, SETTINGS, DFlash2DraftModel
from diffdraft.drafters.dflash_model import draft_setting
from diffdraft.errors import ExportError
from diffdraft.export.layout import serving_config as dflash_serving_config
from diffdraft.export.layout import serving_weights

OPTIONAL_SETTINGS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
"""The optional ``dflash_config`` settings and the value that means "off" (written only when set)."""
GGUF_LAYER_NAMES = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
"""Our DFlash2 layer weights by llama.cpp's ``blk.N.*`` names (beside DFlash's)."""
GGUF_TOP_NAMES = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
FLOAT_GGUF_NAMES = ("attn_conv_base", "ffn_conv_base")
"""Kept float32 in the GGUF: the base kernels are added to float32 per-row offsets in the graph."""


def serving_config(model: DFlash2DraftModel) -> dict:
    """DFlash's serving config (vLLM's reading of it) with DFlash2's architecture and settings."""
    config = dflash_serving_config(model)
    config["architectures"] = [ARCHITECTURE]
    settings = {key: int(draft_setting(model.config, key)) for key in SETTINGS}
    for key, off in OPTIONAL_SETTINGS.items():
        value = float(draft_setting(model.config, key, off) or off)
        if value != off:
            settings[key] = value
    config["dflash_config"] |= {"block_size": model.block_size, **settings}
    return config


def vllm_weights(model: DFlash2DraftModel) -> dict[str, torch.Tensor]:
    """Every weight under its own name: ours are vLLM's (checked in tests/export/test_dflash2_export.py)."""
    return serving_weights(model)


def refuse_sglang() -> None:
    """SGLang cannot run a DFlash2 drafter (module docstring)."""
    raise ExportError(
        "this is a DFlash2 drafter; SGLang has no DFlash2 model (no DFlash2DraftModel in its registry, "
        "and its DFlash model would skip the block convs and the candidate selector): export it with "
        "--format vllm or --format llama.cpp"
    )


def gguf_metadata(model: DFlash2DraftModel, arch: str) -> dict:
    """The GGUF keys DFlash2 adds to DFlash's; refuses a hidden size llama.cpp cannot pack the
    selector lattice into."""
    top_k = int(draft_setting(model.config, "selector_top_k"))
    hidden = int(model.config.hidden_size)
    if hidden < top_k * (top_k + 1):
        raise ExportError(
            f"llama.cpp packs DFlash2's selector scores (top_k + top_k^2 = {top_k * (top_k + 1)} values) "
            f"into one hidden-size row, and this drafter's hidden size is {hidden}: export it with "
            "--format vllm"
        )
    metadata = {f"{arch}.{key}": int(draft_setting(model.config, key)) for key in SETTINGS}
    scales = {
        "output_multiplier": "logit_scale",
        "final_logit_softcapping": "final_logit_softcapping",
        "input_embedding_scale": "embedding_scale",
    }
    for ours, theirs in scales.items():
        off = OPTIONAL_SETTINGS[ours]
        value = float(draft_setting(model.config, ours, off) or off)
        if value != off:
            metadata[f"{arch}.{theirs}"] = value
    return metadata
