"""DFlash2 drafters load in vLLM's layout unchanged and draft losslessly: greedy ``chain`` and
``ddtree`` over a random DFlash2 drafter are token-identical to the target's own greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffdraft.drafters.base import Proposal, propose_together
from diffdraft.drafters.block_conv import BlockConv
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.conditional_proposal import ConditionalProposal
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash2_model import DFlash2DraftModel
from diffdraft.drafters.families import DFLASH2_FAMILY, family_of, make_drafter, variants
from diffdraft.errors import CheckpointError
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, TreeRound

from diffdraft_testing.conditionals import assert_top_prefixes
from diffdraft_testing.drafters import DFLASH_LAYER_WEIGHTS, forks_with_contexts, tiny_dflash2
from diffdraft_testing.engine import run_engine, saved_drafter_matches_ar
from diffdraft_testing.targets import hf_greedy, tiny_target
from diffdraft_testing.trees import prefixes

LAYER_KEYS = DFLASH_LAYER_WEIGHTS | {
    "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight",
}
"""A DFlash2 layer's weights, named as vLLM's ``qwen3_dflash2`` loads them."""
MODEL_KEYS = {
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
}


def test_a_checkpoint_in_vllms_layout_round_trips(tmp_path):
    target = tiny_target("qwen3")
    model = tiny_dflash2(target)
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert set(config["dflash_config"]) == {
        "block_size",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "mask_token_id",
        "target_layer_ids",
    }
    layers = {f"layers.{i}.{key}" for i in range(2) for key in LAYER_KEYS}
    assert set(load_file(tmp_path / "model.safetensors")) == layers | MODEL_KEYS
    loaded = load_draft_model(tmp_path)
    assert type(loaded) is DFlash2DraftModel and family_of(loaded) is DFLASH2_FAMILY
    assert isinstance(make_drafter(loaded, TargetModel(target)), DFlashDrafter)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert "dflash2" in variants()  # and `train fit --variant dflash2` makes them


def test_a_config_without_the_selector_is_refused(tmp_path):
    save_draft_model(tiny_dflash2(tiny_target("qwen3")), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dflash_config"]["selector_top_k"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="selector_top_k"):
        load_draft_model(tmp_path)


@pytest.mark.parametrize(
    "setting, value",
    [
        ("causal", True),
        ("use_swa", True),
        ("attention_sink_bias", True),
        ("attention_value_scale", 0.5),
        ("use_aux_hidden_state", False),
    ],
)
def test_a_backbone_setting_diffdraft_does_not_run_is_refused_not_ignored(tmp_path, setting, value):
    save_draft_model(tiny_dflash2(tiny_target("qwen3")), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"][setting] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{setting}.*which diffdraft's DFlash backbone does not run"):
        load_draft_model(tmp_path)


def test_a_checkpoint_with_a_separate_mask_embedding_is_refused(tmp_path):
    save_draft_model(tiny_dflash2(tiny_target("qwen3")), tmp_path)
    torch.save(torch.zeros(32), tmp_path / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match=r"ships mask_embedding\.pt"):
        load_draft_model(tmp_path)


def test_a_block_conv_row_reads_only_the_rows_before_it_in_its_block():
    torch.manual_seed(0)
    conv = BlockConv(hidden_size=8, taps=3, group_size=2).double()
    torch.nn.init.normal_(conv.base_kernel)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    later = x.clone()
    later[:, 3:] = torch.randn(2, 2, 8, dtype=torch.float64)
    out, offsets = conv.prepare(x)
    torch.testing.assert_close(conv.prepare(later)[0][:, :3], out[:, :3], rtol=0, atol=0)
    torch.testing.assert_close(conv.prepare(x[:, :3])[0], out[:, :3], rtol=0, atol=0)
    assert conv.finish(x, offsets).shape == x.shape


@pytest.mark.parametrize("builder", [ChainBuilder(), DDTreeBuilder(12)], ids=["chain", "ddtree"])
@pytest.mark.parametrize("family, seed", [("qwen3", 1), ("llama", 2)])
def test_greedy_drafting_is_identical_to_the_targets_greedy_decoding(builder, family, seed):
    target = tiny_target(family, seed=seed)
    prompt = torch.randint(1, 62, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = hf_greedy(target, prompt, 24, 63)
    drafter = DFlashDrafter(tiny_dflash2(target, seed=seed), TargetModel(target))
    assert drafter.max_depth == 4
    assert run_engine(target, drafter, builder, prompt, 24, 63)[0] == reference


def test_one_forward_drafts_every_fork_as_each_drafts_alone():
    target = tiny_target("qwen3", seed=3)
    drafter = DFlashDrafter(tiny_dflash2(target, seed=3), TargetModel(target))
    forks, token_ids = forks_with_contexts(drafter, [7, 2, 12], 3, target.config.hidden_size)
    depths = [4, 2, 1]
    for fork, ids, depth, together in zip(
        forks, token_ids, depths, propose_together(forks, token_ids, depths), strict=True
    ):
        alone = fork.propose(ids, depth).log_probs
        assert torch.isfinite(alone).sum(-1).tolist() == [6] * depth  # the selector's top-K candidates
        torch.testing.assert_close(together.log_probs, alone, rtol=0, atol=1e-12)


def test_a_saved_checkpoint_drafts_through_the_generator_token_identical_to_ar(tmp_path):
    saved_drafter_matches_ar(tiny_dflash2, tmp_path)


def test_a_ddtree_holds_the_likeliest_paths_under_the_selectors_chain_rule():
    """Each drafted token's successors are scored after it (the selector's score of each candidate
    after that token, as training computes it), not after the greedy chain's token: the tree is the
    brute-force top-B paths."""
    target = tiny_target("qwen3", seed=8)
    model = tiny_dflash2(target, seed=8)
    head = target.get_output_embeddings()
    generator = torch.Generator().manual_seed(8)
    hidden = 4 * torch.randn(1, 3, target.config.hidden_size, generator=generator, dtype=torch.float64)
    selector = model.candidate_selector
    with torch.no_grad():
        unary, candidates = head(hidden)[0].float().topk(selector.top_k, dim=-1)
        unary = model.unary_scores(unary)

        def row(position: int, previous: int) -> dict[int, float]:
            states, ids = hidden[0, position : position + 1], candidates[position : position + 1]
            scores = selector.scores_after(
                states, ids, unary[position : position + 1], torch.tensor([previous])
            )
            return dict(zip(ids[0].tolist(), scores[0].log_softmax(-1).tolist(), strict=True))

        conditionals = model.draft_conditionals(hidden, head)[0]
    proposal = ConditionalProposal(conditionals, torch.tensor([9]), 64)
    tree, scores = DDTreeBuilder(8).ranked(TreeRound(9, proposal, SamplingParams(), None))
    assert_top_prefixes(tree, scores, row, 9, 3, 8)
    greedy_chains = DDTreeBuilder(8).build(
        TreeRound(9, Proposal(log_probs=proposal.log_probs), SamplingParams(), None)
    )
    assert prefixes(tree) != prefixes(greedy_chains)
