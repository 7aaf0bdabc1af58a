"""Training batches built by hand, the objectives' batch-versus-alone check, the train command's
argument parser, a target's own responses to train on and a run's logged losses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diffdraft.train.batch import TrainingBatch, pad_right
from diffdraft.train.dataset import TrainingSample


def sequences_batch(sequences: list[tuple]) -> TrainingBatch:
    """A training batch from (token_ids, anchors, taps or None, target logits or None, response start)
    per sequence, right-padded as the trainer pads."""

    def stacked(k: int) -> torch.Tensor | None:
        return None if sequences[0][k] is None else pad_right([s[k] for s in sequences])

    return TrainingBatch(
        stacked(0),
        [s[0].shape[0] for s in sequences],
        [s[1] for s in sequences],
        [s[4] for s in sequences],
        stacked(2),
        stacked(3),
    )


def assert_batch_matches_each_sequence(
    objective: torch.nn.Module, sequences: list[tuple], gamma: float
) -> None:
    """One padded forward over ``sequences`` gives the mean of their losses and the sums of their
    statistics, as each alone does."""
    with torch.no_grad():
        alone = [objective(sequences_batch([sequence]), gamma) for sequence in sequences]
        loss, hits, agreements, counts = objective(sequences_batch(sequences), gamma)
    torch.testing.assert_close(loss, torch.stack([a[0] for a in alone]).mean())
    for k, batched in ((1, hits), (2, agreements), (3, counts)):
        assert batched.tolist() == sum(a[k] for a in alone).tolist()


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """Command-line arguments ``["train", ...]`` as ``diffdraft`` parses them."""
    from diffdraft.train.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="diffdraft")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def greedy_samples(model: torch.nn.Module, count: int, seed: int, response: int = 24) -> list[TrainingSample]:
    """The target's own greedy responses to random 6-token prompts (what regeneration produces)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = torch.randint(1, model.config.vocab_size - 1, (6,), generator=generator)
        out = model.generate(
            prompt[None],
            max_new_tokens=response,
            min_new_tokens=response,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        samples.append(TrainingSample(f"s{seed}-{i}", out[0], 6))
    return samples


def logged_losses(run_dir: Path) -> list[float]:
    """The loss of every step a run logged, in order."""
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def greedy_block_hits(objective: torch.nn.Module, model: torch.nn.Module, target: torch.nn.Module, seed: int):
    """(hits, counts) per depth of ``objective`` on one block whose drafted tokens are the drafter's
    own greedy draft: drafting's one-pass proposal after a random prefix, computed as the drafter
    computes it (context strictly before the root, the root's block, the greedy chain), then those
    tokens appended to the prefix and anchored at the root. Teacher forcing on them must then pick
    every one of them: where it does not, training conditions on other inputs than drafting."""
    from diffdraft.target.model import TargetModel

    prefix = torch.randint(
        1, target.config.vocab_size - 2, (10,), generator=torch.Generator().manual_seed(seed)
    )
    root = prefix.shape[0] - 1
    taps = TargetModel(target).taps(prefix, model.target_layer_ids)
    rows = model.block_rows(model.max_depth)
    block = torch.full((rows,), model.mask_token_id)
    block[0] = prefix[-1]
    embed = target.get_input_embeddings()
    with torch.no_grad():
        context = model.context_kv(taps[None, :root], torch.arange(root)[None])
        hidden = model(embed(block)[None], torch.arange(root, root + rows)[None], context)
        drafted = model.draft_log_probs(
            hidden[:, model.anchor_rows :], target.get_output_embeddings(), block[:1]
        ).argmax(-1)[0]
        ids = torch.cat([prefix, drafted])
        out = TargetModel(target).taps_and_logits(ids, model.target_layer_ids)
        batch = TrainingBatch(ids[None], [ids.shape[0]], [torch.tensor([root])], [0], out.hidden[None])
        _, hits, _, counts = objective(batch, 4.0)
    return hits, counts
