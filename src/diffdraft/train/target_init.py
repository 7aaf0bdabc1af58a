"""Start a drafter from the target's own top layers instead of random weights.

A draft layer has the shape of a target decoder layer, so the target's last ``L`` layers (and its
final norm) can seed the ``L`` draft layers: the drafter starts from functions that already map
late hidden states to the LM head's space. DFlare's separate context projections start as copies
of the same layer's key/value projections, its context norm as that layer's input norm. The
query/key norms of the Qwen3-style draft attention have no counterpart in Llama-style targets and
stay at one; target attention biases (Qwen2) are not carried, since draft layers have none.
"""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.errors import InvalidRequestError


def copy_target_layers(drafter: DFlashDraftModel, target_model: nn.Module) -> list[int]:
    """Copy the target's last ``len(drafter.layers)`` decoder layers into the draft layers, in order.

    Returns the indices of the target layers copied. Raises if the drafter's geometry (hidden size,
    heads, MLP width) differs from the target's, which makes the weights incompatible.
    """
    decoder = target_model.get_decoder()
    count = len(drafter.layers)
    if count > len(decoder.layers):
        raise InvalidRequestError(
            f"cannot initialise {count} draft layers from a target with {len(decoder.layers)} layers; "
            "use fewer draft layers or random initialisation"
        )
    chosen = list(range(len(decoder.layers) - count, len(decoder.layers)))
    with torch.no_grad():
        for draft, index in zip(drafter.layers, chosen, strict=True):
            source = decoder.layers[index]
            attn, source_attn = draft.self_attn, source.self_attn
            pairs = [
                (attn.q_proj, source_attn.q_proj),
                (attn.k_proj, source_attn.k_proj),
                (attn.v_proj, source_attn.v_proj),
                (attn.o_proj, source_attn.o_proj),
                (draft.mlp.gate_proj, source.mlp.gate_proj),
                (draft.mlp.up_proj, source.mlp.up_proj),
                (draft.mlp.down_proj, source.mlp.down_proj),
                (draft.input_layernorm, source.input_layernorm),
                (draft.post_attention_layernorm, source.post_attention_layernorm),
            ]
            if attn.context_k_proj is not None:
                pairs += [
                    (attn.context_k_proj, source_attn.k_proj),
                    (attn.context_v_proj, source_attn.v_proj),
                ]
            if draft.context_norm is not None:
                pairs.append((draft.context_norm, source.input_layernorm))
            for mine, theirs in pairs:
                _copy_weight(mine, theirs, index)
        _copy_weight(drafter.norm, decoder.norm, "final norm")
    return chosen


def _copy_weight(mine: nn.Module, theirs: nn.Module, where: object) -> None:
    if mine.weight.shape != theirs.weight.shape:
        raise InvalidRequestError(
            f"target layer {where} has weights of shape {tuple(theirs.weight.shape)}, the draft layer "
            f"{tuple(mine.weight.shape)}: initialising from the target needs the target's hidden size, "
            "heads and MLP width (leave --intermediate-size unset), or use random initialisation"
        )
    mine.weight.copy_(theirs.weight.to(mine.weight.dtype))
