"""``train fit --variant dspark``: a fresh Qwen3 DSpark drafter in vLLM's layout learns, resumes exactly,
and once saved drafts losslessly; its objective weights and conditions rows as the public trainers do."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.dspark_model import DSPARK, DSparkDraftModel
from diffdraft.errors import InvalidRequestError
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch
from diffdraft.train.config import TrainConfig
from diffdraft.train.dspark_objective import MarkovObjective, new_dspark_drafter
from diffdraft.train.trainer import Trainer

from diffdraft_testing.drafters import tiny_dspark
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
        variant=DSPARK,
        num_layers=1,
        block_size=4,
        target_layer_ids=[0, 2],
        mask_token_id=62,
        batch_size=4,
        epochs=4,
        learning_rate=3e-3,
        save_every=5,
        anchors_per_sequence=8,
        markov_rank=4,
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
    trainer = Trainer(settings(tmp_path, labels=labels, epochs=8), TargetModel(bigram_target), samples)
    assert isinstance(trainer.drafter, DSparkDraftModel) and trainer.drafter.max_depth == 4
    trainer.train()
    losses = logged_losses(tmp_path)
    assert len(losses) == 32 and sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses


def test_an_interrupted_run_resumes_to_the_state_of_an_uninterrupted_one(bigram_target, tmp_path):
    samples = greedy_samples(bigram_target, 12, 3)
    straight = Trainer(settings(tmp_path / "straight"), TargetModel(bigram_target), samples)
    straight.train()

    class Killed(Exception):
        pass

    def kill_at_step_7(step: int) -> None:
        if step == 7:
            raise Killed

    with pytest.raises(Killed):
        Trainer(settings(tmp_path / "resumed"), TargetModel(bigram_target), samples).train(
            on_step=kill_at_step_7
        )
    resumed = Trainer(settings(tmp_path / "resumed"), TargetModel(bigram_target), samples)
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


def test_every_row_drafts_the_token_after_it_with_the_true_previous_token_in_its_markov_bias():
    """Row k of a block anchored at a drafts token a + k + 1 (depth k + 1) after token a + k: a Markov
    head that only rewards that pairing gives every row its own token, at every depth."""
    target = tiny_target("llama", seed=2, vocab=64, layers=3, dtype=torch.float64)
    model = new_dspark_drafter(settings("", target_layer_ids=[0, 1]), TargetModel(target), None).double()
    ids = torch.randperm(60, generator=torch.Generator().manual_seed(0))[:20] + 1
    successor = torch.zeros(64, dtype=torch.long)
    successor[ids[:-1]] = ids[1:]
    with torch.no_grad():  # previous token p adds 1000 to the logit of the token after p in ids
        model.markov_head.markov_w1 = nn.Embedding.from_pretrained(torch.eye(64, dtype=torch.float64))
        model.markov_head.markov_w2 = nn.Linear(64, 64, bias=False).double()
        model.markov_head.markov_w2.weight.copy_(F.one_hot(successor, 64).T * 1e3)
    del model.confidence_head  # it reads the rank-4 embedding this test replaced
    out = TargetModel(target).taps_and_logits(ids, model.target_layer_ids)
    batch = TrainingBatch(ids[None], [20], [torch.tensor([2, 9, 14])], [0], out.hidden[None])
    with torch.no_grad():
        _, hits, agreements, counts = MarkovObjective(model, target)(batch, 4.0)
    assert counts.tolist() == [0, 3, 3, 3, 3]  # the block at 14 drafts tokens 15 .. 18: all inside
    assert hits.tolist() == counts.tolist() and agreements.tolist() == [0] * 5


def test_a_padded_batch_trains_as_its_sequences_one_by_one():
    target = tiny_target("qwen3", seed=5, vocab=64, layers=3, dtype=torch.float64)
    model = new_dspark_drafter(settings("", target_layer_ids=[0, 1]), TargetModel(target), None).double()
    objective = MarkovObjective(model, target)
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for n, anchors in ((11, [2, 5, 9]), (23, [4, 10, 18, 21]), (17, [7])):
        ids = torch.randint(1, 60, (n,), generator=generator)
        out = TargetModel(target).taps_and_logits(ids, model.target_layer_ids)
        sequences.append((ids, torch.tensor(anchors), out.hidden, out.logits, 0))
    assert_batch_matches_each_sequence(objective, sequences, 4.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_teacher_forcing_on_the_drafters_own_greedy_draft_picks_every_token_of_it(seed):
    """Training conditions each drafted position on the true previous token; on a text that is the
    drafter's own greedy draft that is the greedy chain drafting conditions on, so every depth hits."""
    target = tiny_target("qwen3", seed=seed, vocab=64, layers=3, dtype=torch.float64)
    model = tiny_dspark(target, seed=seed)
    hits, counts = greedy_block_hits(MarkovObjective(model, target), model, target, seed)
    assert counts[1:].tolist() == [1.0] * model.max_depth and torch.equal(hits, counts)


def test_bad_options_name_the_fix(tmp_path):
    with pytest.raises(InvalidRequestError, match="drop --draft-vocab-size"):
        settings(tmp_path, draft_vocab_size=32)
    with pytest.raises(InvalidRequestError, match="--markov-rank must be at least 1"):
        settings(tmp_path, markov_rank=0)
