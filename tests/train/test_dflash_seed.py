"""A DFlash drafter seeded from a DFlare one."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.errors import InvalidRequestError
from diffdraft.train.dflash_seed import dflash_from_dflare

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


def _dflare(layers: int = 2, shared_fusion: bool = False):
    target = tiny_target(dtype=torch.float32, layers=4)
    dflare = tiny_drafter(
        target, layers=layers, variant=DFLARE, target_layer_ids=[0, 1, 3], draft_vocab=[3, 9, 20]
    )
    rows = 1 if shared_fusion else layers  # one row for all: every layer fuses and norms alike
    with torch.no_grad():
        dflare.fusion.weight.copy_(torch.randn(rows, 3).expand(layers, 3))
        for layer, norm in zip(dflare.layers, (torch.rand(rows, 32) + 0.5).expand(layers, 32), strict=True):
            layer.context_norm.weight.copy_(norm)
    return dflare


def test_the_seed_keeps_the_taps_block_mask_vocabulary_and_every_shared_weight():
    dflare = _dflare()
    dflash = dflash_from_dflare(dflare)
    assert dflash.variant == DFLASH and dflash.config.architectures == ["DFlashDraftModel"]
    assert dflare.variant == DFLARE  # the source is left as it was
    assert dflash.target_layer_ids == [0, 1, 3] and dflash.block_size == dflare.block_size
    assert dflash.mask_token_id == dflare.mask_token_id
    assert dflash.draft_vocab.tolist() == [3, 9, 20]
    theirs = dflare.state_dict()
    for name, value in dflash.state_dict().items():
        if name.startswith(("fc.", "hidden_norm.")) or name.endswith(("k_proj.weight", "v_proj.weight")):
            continue
        torch.testing.assert_close(value, theirs[name], msg=name)


def test_fc_sums_the_taps_with_the_fusion_weights_averaged_over_the_draft_layers():
    dflare = _dflare(layers=3)
    dflash = dflash_from_dflare(dflare)
    taps = torch.randn(2, 5, 3, 32)
    averaged = dflare.fusion.weight.softmax(-1).mean(0)
    torch.testing.assert_close(dflash.fc(taps.flatten(-2)), torch.matmul(averaged, taps))


def test_a_dflare_whose_layers_fuse_alike_gives_the_same_context_keys_and_values():
    dflare = _dflare(layers=2, shared_fusion=True)
    dflash = dflash_from_dflare(dflare)
    taps, positions = torch.randn(1, 6, 3, 32), torch.arange(6)[None]
    for (k, v), (k_ref, v_ref) in zip(
        dflash.context_kv(taps, positions), dflare.context_kv(taps, positions), strict=True
    ):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)


def test_only_a_dflare_seeds_a_dflash():
    target = tiny_target(dtype=torch.float32, layers=4)
    with pytest.raises(InvalidRequestError, match="only from a DFlare drafter; this one is 'dflash'"):
        dflash_from_dflare(tiny_drafter(target, variant=DFLASH))
