"""``train fit --variant dflash2``: a fresh DFlash2 drafter in vLLM's layout starts as the DFlash network
it extends, learns, resumes exactly, and once saved drafts losslessly."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.dflash2_model import DFLASH2, DFlash2DraftModel
from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.errors import InvalidRequestError
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.dflash2_objective import SelectorObjective, new_dflash2_drafter
from diffdraft.train.trainer import Trainer

from diffdraft_testing.drafters import tiny_dflash2
from diffdraft_testing.engine import saved_drafter_matches_ar
from diffdraft_testing.targets import tiny_target
from diffdraft_testing.training import (
    assert_batch_matches_each_sequence,
    greedy_block_hits,
    greedy_samples,
    logged_losses,
)


def settings(run_dir, **overrides) -> TrainConfig:
    base = dict(
        output_dir=str(run_dir),
        variant=DFLASH2,
        num_layers=1,
        block_size=4,
        target_layer_ids=[0, 2],
        mask_token_id=62,
        batch_size=4,
        epochs=8,
        learning_rate=3e-3,
        save_every=5,
        anchors_per_sequence=8,
        conv_group_size=8,
        selector_rank=4,
        selector_top_k=8,
    )
    return TrainConfig(**(base | overrides))


@pytest.fixture(scope="module")
def bigram_target():
    """Its next token depends on the current one only (attention output zeroed): learnable in seconds."""
    model = tiny_target("llama", seed=11, vocab=64, layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.mark.parametrize("labels", ["target", "tokens"])
def test_a_few_steps_lower_the_loss(bigram_target, tmp_path, labels):
    samples = greedy_samples(bigram_target, 16, 1)
    trainer = Trainer(settings(tmp_path, labels=labels), TargetModel(bigram_target), samples)
    assert isinstance(trainer.drafter, DFlash2DraftModel) and trainer.drafter.max_depth == 3
    trainer.train()
    losses = logged_losses(tmp_path)
    assert len(losses) == 32 and sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses


def test_an_interrupted_run_resumes_to_the_state_of_an_uninterrupted_one(bigram_target, tmp_path):
    samples = greedy_samples(bigram_target, 12, 3)
    straight = Trainer(settings(tmp_path / "straight", epochs=4), TargetModel(bigram_target), samples)
    straight.train()

    class Killed(Exception):
        pass

    def kill_at_step_7(step: int) -> None:
        if step == 7:
            raise Killed

    interrupted = Trainer(settings(tmp_path / "resumed", epochs=4), TargetModel(bigram_target), samples)
    with pytest.raises(Killed):
        interrupted.train(on_step=kill_at_step_7)
    resumed = Trainer(settings(tmp_path / "resumed", epochs=4), TargetModel(bigram_target), samples)
    assert resumed.state.step == 5
    resumed.train()
    for name, tensor in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], tensor, rtol=0, atol=0)
    assert logged_losses(tmp_path / "resumed") == logged_losses(tmp_path / "straight")


def test_the_trained_drafter_saved_in_vllms_layout_drafts_like_ar(tmp_path):
    def trained(target: torch.nn.Module) -> torch.nn.Module:
        run = settings(tmp_path / "run", target_layer_ids=[0, 1], mask_token_id=target.config.vocab_size - 2)
        Trainer(run, TargetModel(target), greedy_samples(target, 8, 4)).train()
        return load_draft_model(tmp_path / "run" / "final")

    saved_drafter_matches_ar(trained, tmp_path, methods=("chain", "ddtree"))


def test_a_fresh_drafter_computes_what_the_dflash_network_with_its_weights_computes():
    """Its block convs start as the identity, so training starts from DFlash and learns what to mix."""
    target = tiny_target("qwen3", seed=4, vocab=64, layers=3, dtype=torch.float64)
    model = new_dflash2_drafter(settings("", target_layer_ids=[0, 1]), TargetModel(target), None).double()
    dflash = DFlashDraftModel(model.config).double()
    dflash.load_state_dict(model.state_dict(), strict=False)
    taps = torch.randn(1, 9, 2, target.config.hidden_size, dtype=torch.float64)
    embeds = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(9, 13)[None]
    with torch.no_grad():
        mine = model(embeds, positions, model.context_kv(taps, torch.arange(9)[None]))
        theirs = dflash(embeds, positions, dflash.context_kv(taps, torch.arange(9)[None]))
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("distilled", [False, True])
def test_a_padded_batch_trains_as_its_sequences_one_by_one(distilled):
    target = tiny_target("qwen3", seed=5, vocab=64, layers=3, dtype=torch.float64)
    model = new_dflash2_drafter(settings("", target_layer_ids=[0, 1]), TargetModel(target), None).double()
    objective = SelectorObjective(model, target)
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for n, anchors in ((11, [2, 5, 9]), (23, [4, 10, 18, 21]), (17, [7])):
        ids = torch.randint(1, 60, (n,), generator=generator)
        out = TargetModel(target).taps_and_logits(ids, model.target_layer_ids)
        sequences.append((ids, torch.tensor(anchors), out.hidden, out.logits if distilled else None, 0))
    assert_batch_matches_each_sequence(objective, sequences, 4.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_teacher_forcing_on_the_drafters_own_greedy_draft_picks_every_token_of_it(seed):
    """Training conditions each drafted position on the true previous token; on a text that is the
    drafter's own greedy draft that is the greedy chain drafting conditions on, so every depth hits."""
    target = tiny_target("qwen3", seed=seed, vocab=64, layers=3, dtype=torch.float64)
    model = tiny_dflash2(target, seed=seed)
    hits, counts = greedy_block_hits(SelectorObjective(model, target), model, target, seed)
    assert counts[1:].tolist() == [1.0] * model.max_depth and torch.equal(hits, counts)


def test_bad_options_name_the_fix(bigram_target, tmp_path):
    with pytest.raises(InvalidRequestError, match="drop --draft-vocab-size"):
        settings(tmp_path, draft_vocab_size=32)
    with pytest.raises(InvalidRequestError, match="--selector-top-k must be at least 1"):
        settings(tmp_path, selector_top_k=0)
    samples = greedy_samples(bigram_target, 4, 5)
    with pytest.raises(
        InvalidRequestError, match="--conv-group-size 5 must divide the target's hidden size 32"
    ):
        Trainer(settings(tmp_path, conv_group_size=5), TargetModel(bigram_target), samples)
    with pytest.raises(InvalidRequestError, match="--selector-top-k 65 exceeds"):
        Trainer(settings(tmp_path, selector_top_k=65), TargetModel(bigram_target), samples)
