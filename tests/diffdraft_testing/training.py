"""Training batches built by hand, the objectives' batch-versus-alone check, and the train command's
argument parser."""

from __future__ import annotations

import argparse

import torch

from diffdraft.train.batch import TrainingBatch, pad_right


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
