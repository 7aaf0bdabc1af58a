"""Qwen3 DSpark drafters load in vLLM's layout unchanged and draft losslessly: greedy ``chain`` and
``ddtree`` over a random DSpark drafter (whole vocabulary, or its own head over a reduced one) are
token-identical to the target's own greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffdraft.drafters.base import Proposal, propose_together, vocab_columns
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.conditional_proposal import ConditionalProposal
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dspark_model import DSparkDraftModel
from diffdraft.drafters.families import DSPARK_FAMILY, family_of
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, TreeRound

from diffdraft_testing.conditionals import assert_top_prefixes
from diffdraft_testing.drafters import forks_with_contexts, tiny_dspark
from diffdraft_testing.engine import run_engine, saved_drafter_matches_ar
from diffdraft_testing.targets import hf_greedy, tiny_target
from diffdraft_testing.trees import prefixes

HALF = list(range(0, 64, 2))


def test_a_reduced_vocabulary_checkpoint_in_vllms_layout_loads_unchanged(tmp_path):
    target = tiny_target("qwen3")
    model = tiny_dspark(target, draft_vocab=HALF)
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert (config["markov_rank"], config["draft_vocab_size"], config["dspark_noise_token_id"]) == (8, 32, 62)
    weights = load_file(tmp_path / "model.safetensors")
    heads = {"lm_head.weight", "d2t", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    assert heads | {"confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight"} <= set(weights)
    assert weights["markov_head.markov_w2.weight"].shape == (32, 8)
    weights["t2d"] = torch.zeros(64, dtype=torch.bool)  # training-only, as released checkpoints ship it
    save_file(weights, tmp_path / "model.safetensors")
    config["architectures"], config["model_type"] = ["DSparkDraftModel"], "qwen3"  # the other name vLLM takes
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_draft_model(tmp_path)
    assert type(loaded) is DSparkDraftModel and family_of(loaded) is DSPARK_FAMILY
    assert loaded.draft_vocab.tolist() == HALF and loaded.max_depth == 4
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_whole_vocabulary_checkpoint_that_ships_a_head_scores_with_it(tmp_path):
    target = tiny_target("qwen3", seed=6)
    model = tiny_dspark(target, seed=6)
    model.use_shipped_head({"lm_head.weight"})  # as if trained with a head of its own
    torch.nn.init.normal_(model.lm_head.weight, std=0.2)
    save_draft_model(model, tmp_path)
    loaded = load_draft_model(tmp_path)
    assert loaded.draft_vocab is None
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    drafter = DFlashDrafter(loaded, TargetModel(target))
    assert drafter.head is loaded.lm_head
    prompt = [3, 14, 15, 9, 26, 5]
    assert run_engine(target, drafter, DDTreeBuilder(12), prompt, 24, 63)[0] == hf_greedy(
        target, prompt, 24, 63
    )


@pytest.mark.parametrize("builder", [ChainBuilder(), DDTreeBuilder(12)], ids=["chain", "ddtree"])
@pytest.mark.parametrize(
    "draft_vocab, top_k",
    [(None, None), (HALF, None), (HALF, 5)],
    ids=["whole-vocab", "reduced-vocab", "top-k"],
)
@pytest.mark.parametrize("family, seed", [("qwen3", 1), ("llama", 2)])
def test_greedy_drafting_is_identical_to_the_targets_greedy_decoding(
    builder, draft_vocab, top_k, family, seed
):
    target = tiny_target(family, seed=seed)
    prompt = torch.randint(1, 62, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = hf_greedy(target, prompt, 24, 63)
    model = tiny_dspark(target, seed=seed, draft_vocab=draft_vocab)
    model.draft_top_k = top_k
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(std=0.5)  # a Markov term that weighs in
    drafter = DFlashDrafter(model, TargetModel(target))
    assert run_engine(target, drafter, builder, prompt, 24, 63)[0] == reference


def test_with_dflashs_block_the_anchor_row_drafts_nothing_and_drafting_stays_lossless():
    target = tiny_target("qwen3", seed=5)
    model = tiny_dspark(target, seed=5, sample_from_anchor=False)
    assert (model.max_depth, model.block_rows(3)) == (3, 4)
    prompt = [3, 14, 15, 9, 26, 5]
    drafter = DFlashDrafter(model, TargetModel(target))
    assert run_engine(target, drafter, DDTreeBuilder(12), prompt, 24, 63)[0] == hf_greedy(
        target, prompt, 24, 63
    )


def test_each_position_is_biased_by_the_greedy_chains_token_before_it():
    target = tiny_target("qwen3", seed=4)
    model = tiny_dspark(target, seed=4, draft_vocab=HALF)
    head, roots = model.lm_head, torch.tensor([5, 9])
    hidden = torch.randn(2, 3, target.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        log_probs = model.draft_log_probs(hidden, head, roots)
        previous = roots
        for position in range(3):
            expected = (head(hidden[:, position]) + model.markov_head(previous)).float().log_softmax(-1)
            torch.testing.assert_close(log_probs[:, position], expected, rtol=0, atol=1e-6)
            previous = torch.tensor(HALF)[expected.argmax(-1)]  # a target id: what markov_w1 reads


def test_draft_topk_keeps_each_positions_best_head_logits_only():
    target = tiny_target("qwen3", seed=7)
    model = tiny_dspark(target, seed=7)
    model.draft_top_k = 5
    hidden = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
    head = target.get_output_embeddings()
    with torch.no_grad():
        log_probs = model.draft_log_probs(hidden, head, torch.tensor([9]))
        best = head(hidden).topk(5, dim=-1).indices
    assert torch.equal(
        torch.isfinite(log_probs), torch.zeros_like(log_probs, dtype=torch.bool).scatter(-1, best, True)
    )


def test_one_forward_drafts_every_fork_as_each_drafts_alone():
    target = tiny_target("qwen3", seed=3)
    drafter = DFlashDrafter(tiny_dspark(target, seed=3), TargetModel(target))
    forks, token_ids = forks_with_contexts(drafter, [7, 2, 12], 3, target.config.hidden_size)
    depths = [4, 2, 1]
    for fork, ids, depth, together in zip(
        forks, token_ids, depths, propose_together(forks, token_ids, depths), strict=True
    ):
        torch.testing.assert_close(together.log_probs, fork.propose(ids, depth).log_probs, rtol=0, atol=1e-12)


def test_a_saved_checkpoint_drafts_through_the_generator_token_identical_to_ar(tmp_path):
    saved_drafter_matches_ar(tiny_dspark, tmp_path)


@pytest.mark.parametrize(
    "draft_vocab, top_k",
    [(None, None), (HALF, None), (HALF, 3)],
    ids=["whole-vocab", "reduced-vocab", "top-k"],
)
def test_a_ddtree_holds_the_likeliest_paths_under_the_markov_heads_chain_rule(draft_vocab, top_k):
    """Each drafted token's successors are scored after it, not after the greedy chain's token: the
    tree is the brute-force top-B paths under ``logit_scale * (head(h_l) + markov(previous))``."""
    target = tiny_target("qwen3", seed=8)
    model = tiny_dspark(target, seed=8, draft_vocab=draft_vocab)
    model.draft_top_k = top_k
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(
            std=1.0, generator=generator
        )  # a Markov term that weighs in
    head = model.lm_head or target.get_output_embeddings()
    hidden = 4 * torch.randn(1, 3, target.config.hidden_size, generator=generator, dtype=torch.float64)
    vocab = torch.arange(64) if draft_vocab is None else torch.tensor(HALF)
    with torch.no_grad():
        logits = head(hidden)[0]

        def row(position: int, previous: int) -> dict[int, float]:
            kept = torch.arange(len(vocab)) if top_k is None else logits[position].topk(top_k).indices
            biased = model.logit_scale * (logits[position] + model.markov_head(torch.tensor([previous]))[0])
            return dict(zip(vocab[kept].tolist(), biased[kept].float().log_softmax(-1).tolist(), strict=True))

        conditionals = model.draft_conditionals(hidden, head)[0]
    proposal = ConditionalProposal(conditionals, torch.tensor([9]), 64, vocab_columns(model.draft_vocab))
    tree, scores = DDTreeBuilder(8).ranked(TreeRound(9, proposal, SamplingParams(), None))
    assert_top_prefixes(tree, scores, row, 9, 3, 8)
    greedy_chains = DDTreeBuilder(8).build(
        TreeRound(9, Proposal(log_probs=proposal.log_probs), SamplingParams(), None)
    )
    assert prefixes(tree) != prefixes(greedy_chains)
