"""Seed a DFlash drafter from a trained DFlare, so a deployable drafter starts from what DFlare learned.

llama.cpp, vLLM and SGLang run DFlash, not DFlare. The two share everything but how the target's
features reach the draft layers: DFlare gives layer ``i`` its own softmax-weighted sum of the taps,
normed by its own ``context_norm`` and projected by separate ``context_k_proj`` / ``context_v_proj``;
DFlash computes one context ``hidden_norm(fc(concat(taps)))`` for every layer and projects it with the
same ``k_proj`` / ``v_proj`` as the block rows.

The seed copies every shared weight (attention, MLP, norms, the final norm, the draft vocabulary),
folds the fusion weights averaged over the draft layers into ``fc`` (tap ``j``'s slice of ``fc`` is
``mean_i softmax(fusion)[i, j]`` times the identity), and averages the context norms into
``hidden_norm``. One projection must serve both row kinds; it starts as DFlare's context projection,
because the context rows carry the target's information (docs/decisions.md, "DFlash seeded from
DFlare's context projections"). Training then adapts the rest.
"""

from __future__ import annotations

import copy

import torch

from diffdraft.drafters.dflash_model import DFLARE, DFLASH, DFlashDraftModel
from diffdraft.errors import InvalidRequestError


def dflash_from_dflare(dflare: DFlashDraftModel) -> DFlashDraftModel:
    """A new DFlash drafter with ``dflare``'s taps, block size, mask token and draft vocabulary."""
    if dflare.variant != DFLARE:
        raise InvalidRequestError(
            f"a DFlash drafter can be seeded only from a DFlare drafter; this one is {dflare.variant!r} "
            "(pass it as --init-drafter without --variant to fine-tune it as it is)"
        )
    config = copy.deepcopy(dflare.config)
    config.dflash_config = {**config.dflash_config, "variant": DFLASH}
    config.architectures = ["DFlashDraftModel"]
    parameter = next(dflare.parameters())
    dflash = DFlashDraftModel(config).to(device=parameter.device, dtype=parameter.dtype)
    own = dflash.state_dict()
    dflash.load_state_dict({k: v for k, v in dflare.state_dict().items() if k in own}, strict=False)
    with torch.no_grad():
        for mine, theirs in zip(dflash.layers, dflare.layers, strict=True):
            mine.self_attn.k_proj.weight.copy_(theirs.self_attn.context_k_proj.weight)
            mine.self_attn.v_proj.weight.copy_(theirs.self_attn.context_v_proj.weight)
        tap_weights = dflare.fusion.weight.float().softmax(-1).mean(0)  # [taps]
        hidden = config.hidden_size
        identity = torch.eye(hidden, device=parameter.device)
        dflash.fc.weight.copy_(torch.cat([w * identity for w in tap_weights], dim=1))
        norms = torch.stack([layer.context_norm.weight.float() for layer in dflare.layers])
        dflash.hidden_norm.weight.copy_(norms.mean(0))
    return dflash
