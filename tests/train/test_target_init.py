"""Draft layers initialised from the target's last layers."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.dflash_model import DFLARE, DFlashDraftModel, make_draft_config
from diffdraft.errors import InvalidRequestError
from diffdraft.train.target_init import copy_target_layers

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


def test_draft_layers_compute_what_the_target_s_last_layers_compute_in_their_mlps_and_norms():
    target = tiny_target(dtype=torch.float32, layers=4)
    drafter = tiny_drafter(target, layers=2, variant=DFLARE)
    assert copy_target_layers(drafter, target) == [2, 3]
    x = torch.randn(5, 32)
    for draft, source in zip(drafter.layers, target.model.layers[2:], strict=True):
        torch.testing.assert_close(draft.mlp(x), source.mlp(x))
        torch.testing.assert_close(draft.input_layernorm(x), source.input_layernorm(x))
        torch.testing.assert_close(draft.context_norm(x), source.input_layernorm(x))
        attn = draft.self_attn
        torch.testing.assert_close(attn.context_k_proj.weight, source.self_attn.k_proj.weight)
        torch.testing.assert_close(attn.v_proj(x), source.self_attn.v_proj(x))
    torch.testing.assert_close(drafter.norm(x), target.model.norm(x))


def test_a_drafter_of_another_width_is_refused_with_the_fix():
    target = tiny_target(dtype=torch.float32)
    config = make_draft_config(
        target.config, num_layers=1, block_size=4, mask_token_id=62, target_layer_ids=[0], intermediate_size=8
    )
    with pytest.raises(InvalidRequestError, match="intermediate-size"):
        copy_target_layers(DFlashDraftModel(config), target)
