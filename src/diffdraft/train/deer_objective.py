"""DEER's two-stage Diffusion-to-AR alignment (DEER paper, Sec. 3.1, Eq. 1-4).

One forward trains many blocks of every sequence in a batch: a sequence's rows are causal (as at
inference, where they are the drafter's cached prefix) and each block's rows follow them, seeing the
prefix up to the block's root and the block's own rows bidirectionally (row layout:
:mod:`~diffdraft.drafters.deer_model`).
Row ``r`` of the block rooted at ``a`` sits at position ``a + r`` and predicts token ``a + r + 1``;
row 0 is the root's own prefix row (depth 1).

* Stage 1, continuation distillation (Eq. 1-2): per block a noise level t ~ U(0, 1]; each of the
  ``block_size - 1`` rows after the root holds the mask token with probability t, else the true
  token. A row is trained when the token it predicts is hidden from the block, with weight 1/t;
  every prefix row of the response is also trained at depth 1 (weight 1), which costs nothing.
* Stage 2, Scribe refinement (Eq. 3-4): per block the last R tokens are masked, R ~ U(1, max_suffix);
  the row predicting the i-th of them has weight alpha ** (R - i), so the rows nearest the prefix
  (which verification reaches first) weigh most. The paper saw alpha = 1.05 diverge, 1.01 train.
* Evaluation (``max_suffix`` None): stage 2's shape with R = block_size, inference's exact blocks.

The loss is the weighted mean of the trained rows' cross-entropy to the data's tokens (the target's
answers, as the paper), or of the KL to the target's own distributions when they are given. Noise
is drawn from a generator seeded by the sequence's anchors, themselves drawn from (seed, epoch,
sample), so a resumed run sees the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffdraft.drafters.deer_model import DEERDraftModel, deer_from_causal_lm
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch, pad_right, pad_square_masks
from diffdraft.train.config import TrainConfig
from diffdraft.train.loss import mean_of_sequences, position_counts, position_hits, row_losses, target_rows
from diffdraft.train.recipe import TrainingRecipe


class DEERObjective(nn.Module):
    """DEER drafter -> (loss, hits, agreements, counts) of a batch, like the other objectives
    (per-depth arrays of ``block_size + 1`` entries, index 0 unused). ``gamma`` is stage 2's alpha.

    The whole batch is one drafter forward: each sequence's rows are its ``L`` token rows (``L`` the
    padded length; rows past its own end predict nothing and none of its blocks sees them), then
    its block rows. The loss is the mean of the sequences' weighted means."""

    def __init__(self, drafter: DEERDraftModel, stage: int = 2, max_suffix: int | None = None) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"DEER training stage must be 1 or 2, got {stage}")
        if max_suffix is not None and max_suffix < 1:
            raise ValueError(f"max_suffix must be >= 1, got {max_suffix}")
        self.drafter = drafter
        self.stage = stage
        self.max_suffix = max_suffix

    def forward(
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        model = self.drafter
        sequences, width = batch.token_ids.shape
        device = model.lm_head.weight.device
        layouts = [
            self._rows(batch.token_ids[i, :length], batch.anchors[i], batch.response_starts[i], width, gamma)
            for i, length in enumerate(batch.lengths)
        ]
        input_ids = pad_right(
            [torch.cat([batch.token_ids[i], layout.block_input_ids]) for i, layout in enumerate(layouts)]
        )
        positions = pad_right([layout.positions for layout in layouts])
        visible = pad_square_masks([layout.mask for layout in layouts])
        hidden = model(input_ids.to(device), positions.to(device), visible.to(device)[:, None])

        sequence = torch.cat([torch.full_like(layout.rows, i) for i, layout in enumerate(layouts)])
        rows = torch.cat([layout.rows for layout in layouts])
        predicted = torch.cat([layout.predicted[layout.rows] for layout in layouts])
        size = model.max_depth + 1
        depths = torch.cat([layout.depths[layout.rows] for layout in layouts]).clamp_max(size - 1).to(device)
        row_weights = torch.cat([layout.weights[layout.rows] for layout in layouts]).to(device)
        logits = model.lm_head(hidden[sequence.to(device), rows.to(device)])
        labels = batch.token_ids[sequence, predicted].to(device)
        target_log_probs = greedy = None
        if batch.target_logits is not None:
            target_log_probs, greedy = target_rows(
                batch.target_logits.flatten(0, 1), (sequence * width + predicted - 1).to(device)
            )
        per_row = row_losses(logits, labels, target_log_probs)
        loss = mean_of_sequences(per_row * row_weights, row_weights, sequence.to(device), sequences)
        hits = position_hits(logits, labels, depths, size)
        agreements = torch.zeros_like(hits) if greedy is None else position_hits(logits, greedy, depths, size)
        return loss, hits, agreements, position_counts(depths, size)

    def _rows(
        self, token_ids: torch.Tensor, anchors: torch.Tensor, response_start: int, width: int, gamma: float
    ) -> _SequenceRows:
        """One sequence's rows: its ``width`` token rows (its own ``n`` and padding), then its blocks."""
        n = token_ids.shape[0]
        generator = torch.Generator().manual_seed(int(anchors.sum()) * 1_000_003 + n)
        anchors = anchors[anchors <= n - 2]
        lengths, noise = self._blocks(anchors.shape[0], generator)
        lengths = torch.minimum(lengths, n - 1 - anchors)  # no block predicts past the sequence end
        rows = _block_rows(token_ids, anchors, lengths, noise, self.drafter.mask_token_id, generator)

        prefix = torch.arange(width)
        positions = torch.cat([prefix, rows.positions])
        predicted = positions + 1
        hidden_label = torch.cat([prefix >= max(response_start - 1, 0), rows.label_hidden])
        trained = (predicted < n) & hidden_label
        stage_one = self.stage == 1 and self.max_suffix is not None
        prefix_weights = torch.ones(width)
        if not stage_one:  # depth 1 only where a block is rooted, as the first of its R tokens
            trained[:width] &= torch.isin(prefix, anchors)
            prefix_weights[anchors] = rows.root_weights(gamma)
        return _SequenceRows(
            block_input_ids=rows.input_ids,
            positions=positions,
            predicted=predicted,
            depths=torch.cat([torch.ones(width, dtype=torch.long), rows.steps + 1]),
            weights=torch.cat([prefix_weights, rows.weights(gamma, stage_one)]),
            mask=_visibility(width, anchors, rows),
            rows=trained.nonzero().squeeze(-1),
        )

    def _blocks(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block: how many tokens it predicts, and its mask probability (1 = all masked)."""
        block_size = self.drafter.block_size
        if self.max_suffix is None:
            return torch.full((count,), block_size), torch.ones(count)
        if self.stage == 2:
            return torch.randint(1, self.max_suffix + 1, (count,), generator=generator), torch.ones(count)
        noise = 1 - torch.rand(count, generator=generator)  # U(0, 1]
        return torch.full((count,), block_size), noise


@dataclass
class _SequenceRows:
    """One sequence's share of a batched forward: per row its position, the position of the token it
    predicts, its depth and loss weight; the visibility mask; ``rows`` = the trained ones."""

    block_input_ids: torch.Tensor
    positions: torch.Tensor
    predicted: torch.Tensor
    depths: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor


class _BlockRows:
    """The rows after each block's root, block after block."""

    def __init__(self, owners, steps, positions, input_ids, label_hidden, lengths, noise) -> None:
        self.owners, self.steps, self.positions = owners, steps, positions
        self.input_ids, self.label_hidden = input_ids, label_hidden
        self.lengths, self.noise = lengths, noise
        self.group = torch.arange(lengths.shape[0]).repeat_interleave((lengths - 1).clamp_min(0))

    def weights(self, alpha: float, stage_one: bool) -> torch.Tensor:
        """Per row: 1/t (stage 1) or alpha ** (R - i) for the i-th predicted token (stage 2)."""
        if stage_one:
            return 1 / self.noise[self.group]
        return torch.tensor(alpha, dtype=torch.float64).pow(self.lengths[self.group] - self.steps - 1).float()

    def root_weights(self, alpha: float) -> torch.Tensor:
        return torch.tensor(alpha, dtype=torch.float64).pow(self.lengths - 1).float()


def _block_rows(
    token_ids: torch.Tensor,
    anchors: torch.Tensor,
    lengths: torch.Tensor,
    noise: torch.Tensor,
    mask_token_id: int,
    generator: torch.Generator,
) -> _BlockRows:
    extra = (lengths - 1).clamp_min(0)
    owners = anchors.repeat_interleave(extra)
    starts = torch.cumsum(extra, 0) - extra
    steps = torch.arange(int(extra.sum())) - starts.repeat_interleave(extra) + 1
    positions = owners + steps
    masked = torch.rand(positions.shape[0], generator=generator) < noise.repeat_interleave(extra)
    n = token_ids.shape[0]
    truth = token_ids[positions.clamp_max(n - 1)]
    input_ids = torch.where(masked, torch.full_like(truth, mask_token_id), truth)
    # a row's label (token at position + 1) is hidden unless the next row of its block shows it
    last_of_block = steps == lengths.repeat_interleave(extra) - 1
    next_masked = torch.cat([masked[1:], torch.ones(1, dtype=torch.bool)])
    label_hidden = last_of_block | next_masked
    return _BlockRows(owners, steps, positions, input_ids, label_hidden, lengths, noise)


def _visibility(n: int, anchors: torch.Tensor, rows: _BlockRows) -> torch.Tensor:
    """[q, q] bool over ``[sequence rows ; block rows]`` (True = may attend)."""
    prefix = torch.arange(n)
    sees_prefix = torch.cat(
        [prefix[:, None] >= prefix[None, :], torch.zeros(n, rows.owners.shape[0], dtype=torch.bool)], dim=1
    )
    block_sees_prefix = prefix[None, :] <= rows.owners[:, None]
    block_sees_block = rows.group[:, None] == rows.group[None, :]
    return torch.cat([sees_prefix, torch.cat([block_sees_prefix, block_sees_block], dim=1)], dim=0)


def new_deer_drafter(
    config: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None
) -> DEERDraftModel:
    """A DEER drafter cut from the training target's first ``config.num_layers`` layers, embedding
    and head (``diffdraft deer init``'s recipe). Its own head scores the whole vocabulary, so
    ``draft_vocab`` is not used."""
    return deer_from_causal_lm(
        target.model,
        config.num_layers,
        config.block_size,
        config.mask_token_id,
        config.tokenizer_fingerprint,
        f"first {config.num_layers} layers of the training target",
    )


RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: DEERObjective(drafter, stage, max_suffix),
    new_model=new_deer_drafter,
    gamma_0=1.01,
    fixed_gamma=True,
    reads_mask_as_text=True,
)
"""DEER's recipe: its stage-2 weighting alpha ** (R-i), alpha fixed at 1.01 (its Fig. 6: 1.05
diverged)."""
