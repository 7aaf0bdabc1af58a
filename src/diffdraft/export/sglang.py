"""Export for SGLang's DFlash speculative decoding (``--speculative-algorithm DFLASH``).

What SGLang reads, from its source (sgl-project/sglang, read for facts only):

* ``python/sglang/srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config``): ``block_size``,
  ``num_target_layers``, ``target_layer_ids``, ``mask_token_id`` and ``mask_token`` from
  ``dflash_config`` or the top level; ids must lie in ``[0, target layers)``; ``mask_token``
  defaults to ``"<|MASK|>"``.
* ``python/sglang/srt/models/qwen3.py`` (``Qwen3ForCausalLM.set_dflash_layers_to_capture``): the
  target captures "before layer ``k + 1``" for id ``k``, i.e. ids are DFlash's, written unconverted.
* ``python/sglang/srt/model_executor/model_runner.py``: the capture ids come from the draft config;
  a ``num_target_layers`` unlike the target's only logs a warning.
* ``python/sglang/srt/models/dflash.py`` (``DFlashDraftModel``, the entry class for the
  architecture of that name): Qwen3 fields (``hidden_size``, heads, ``head_dim``, ``rms_norm_eps``,
  rope, ``attention_bias``, ``intermediate_size``, ``hidden_act`` = silu only); ``layer_types``
  ``full_attention`` = non-causal; weights ``layers.{i}.*`` (q/k/v and gate/up stacked on load),
  ``fc.weight`` (its shape checked against the number of ids), ``hidden_norm.weight``,
  ``norm.weight``; no embedding and no LM head; weights it does not know are skipped silently.
* ``python/sglang/srt/speculative/dflash_worker.py`` (``DFlashWorker``): the draft worker skips
  tokenizer init (no tokenizer files needed beside the drafter); the block size is
  ``--speculative-num-draft-tokens`` (a warning if it differs from ``block_size``); drafts are the
  greedy argmax over the target's full LM head, so a draft vocabulary cannot be expressed; a
  ``mask_token`` present in the target tokenizer with another id than ``mask_token_id`` is an error.

DFlash2 drafters are refused (:mod:`diffdraft.export.dflash2`: SGLang has no DFlash2 model); DSpark
drafters go in the layout :mod:`diffdraft.export.dspark` describes, launched with
``--speculative-algorithm DSPARK``.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.drafters.families import DFLASH2_FAMILY, DSPARK_FAMILY, DraftModel, family_of
from diffdraft.errors import ExportError
from diffdraft.export import dflash2, dspark
from diffdraft.export.layout import Engine, Export, serving_config, serving_weights
from diffdraft.target.loading import LoadedModel


def build(model: DraftModel, target: LoadedModel | None) -> Export:
    """The drafter as SGLang loads it: DFlash's layout, or DSpark's; DFlash2 is refused."""
    family = family_of(model)
    if family is DFLASH2_FAMILY:
        dflash2.refuse_sglang()
    if family is DSPARK_FAMILY:
        dspark.check_sglang(model)
        return Export(dspark.serving_config(model), dspark.serving_weights(model))
    return build_dflash(model, target)


def build_dflash(model: DFlashDraftModel, target: LoadedModel | None) -> Export:
    """The official layout; with --target, ``mask_token`` names our mask token so SGLang's check agrees."""
    if model.draft_vocab is not None:
        raise ExportError(
            f"this drafter scores a draft vocabulary of {model.draft_vocab.shape[0]} tokens, but SGLang's "
            "DFlash drafts over the target's full vocabulary: export it with --full-vocabulary (it then "
            "drafts over every token), with --format vllm, or train without one (--draft-vocab-size 0)"
        )
    config = serving_config(model)
    token = _token_text(target, model.mask_token_id) if target is not None else None
    if token:
        config["dflash_config"]["mask_token"] = token
    return Export(config, serving_weights(model))


def _token_text(target: LoadedModel, token_id: int) -> str | None:
    """The tokenizer's text for ``token_id``, or None when the tokenizer has no such id."""
    if not 0 <= token_id < len(target.tokenizer):
        return None
    return target.tokenizer.convert_ids_to_tokens(token_id)


def launch(out: Path, config: dict, target: str) -> str:
    """``sglang.launch_server`` with the exported drafter: DFlash drafts one whole block per step
    (``--speculative-num-draft-tokens`` = ``block_size``); DSpark's flag counts its block plus the
    verified anchor (``dspark_config.py``: gamma = draft tokens - 1, gamma being the block)."""
    block = int(config["block_size"])
    dspark_drafter = config["architectures"] == [dspark.ARCHITECTURE]
    algorithm, tokens = ("DSPARK", block + 1) if dspark_drafter else ("DFLASH", block)
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm "
        f"{algorithm} --speculative-draft-model-path {shlex.quote(str(out))} "
        f"--speculative-num-draft-tokens {tokens}"
    )


ENGINE = Engine("SGLang", build, launch)
