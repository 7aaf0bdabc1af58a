"""The progressive position-weighted loss of DFlare (Eq. 5), on hard or soft (distilled) labels.

Position k of a block is weighted by exp(-(k - 1) / gamma): an early mistake voids the rest of the
block, so early positions matter most. gamma grows linearly from gamma_0 to gamma_max over
training, shifting effort from the easy first positions to the harder tail.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from diffdraft.train.blocks import IGNORE


def gamma_at(step: int, total_steps: int, gamma_0: float, gamma_max: float) -> float:
    return gamma_0 + (step / max(total_steps, 1)) * (gamma_max - gamma_0)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] weights; position 0 (the anchor) has no label and gets weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    block_positions: torch.Tensor,
    weights_by_position: torch.Tensor,
    target_log_probs: torch.Tensor | None = None,
    row_sequence: torch.Tensor | None = None,
    sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted mean loss over labelled rows, plus per-position top-1 hits and counts [B].

    Only labelled rows are passed (``logits`` [r, V], ``labels`` [r], ``block_positions`` [r] in
    1..B-1, ``weights_by_position`` [B], e.g. :func:`position_weights`): the LM head over anchors
    and past-the-end rows would be wasted work. The loss is the
    cross-entropy to ``labels``, or with ``target_log_probs`` [r, V] (the target's own distribution
    over the same rows) the KL divergence KL(target || draft): distillation, as DART trains. A label
    of ``IGNORE`` (a token outside the draft vocabulary) adds no cross-entropy but counts as a miss.

    Rows of several sequences (``row_sequence`` [r], each row's sequence in ``range(sequences)``)
    give the mean of each sequence's weighted mean: a batch trains as its sequences one by one would.
    """
    block_size = weights_by_position.shape[0]
    weights = weights_by_position.to(logits.device)[block_positions]
    if target_log_probs is None:
        weights = weights * (labels != IGNORE)
    weighted = row_losses(logits, labels, target_log_probs) * weights
    if row_sequence is None:
        row_sequence = torch.zeros_like(block_positions)
    return (
        mean_of_sequences(weighted, weights, row_sequence, sequences),
        position_hits(logits, labels, block_positions, block_size),
        position_counts(block_positions, block_size),
    )


def mean_of_sequences(
    weighted: torch.Tensor, weights: torch.Tensor, row_sequence: torch.Tensor, sequences: int
) -> torch.Tensor:
    """The mean over sequences of each one's weighted mean: ``weighted`` [r] = loss x weight per row,
    ``row_sequence`` [r] each row's sequence. A batch trains as its sequences one by one would."""
    totals = weighted.new_zeros(sequences).index_add(0, row_sequence, weighted)
    weight_totals = weights.new_zeros(sequences).index_add(0, row_sequence, weights)
    return (totals / weight_totals.clamp_min(1e-8)).mean()


def row_losses(
    logits: torch.Tensor, labels: torch.Tensor, target_log_probs: torch.Tensor | None
) -> torch.Tensor:
    """[r] cross-entropy to ``labels`` (0 where a label is IGNORE), or with ``target_log_probs``
    [r, V] KL(target || draft)."""
    if target_log_probs is None:
        return F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=IGNORE)
    draft_log_probs = logits.float().log_softmax(-1)
    return F.kl_div(draft_log_probs, target_log_probs, log_target=True, reduction="none").sum(-1)


def position_hits(
    logits: torch.Tensor, labels: torch.Tensor, block_positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B] how many rows at each block position have ``labels`` as their top-1 token."""
    hits = (top_one(logits) == labels).float()
    return torch.zeros(block_size, device=logits.device).index_add_(0, block_positions, hits)


def position_counts(block_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    ones = torch.ones_like(block_positions, dtype=torch.float)
    return torch.zeros(block_size, device=block_positions.device).index_add_(0, block_positions, ones)


def top_one(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximum too), several times faster on bfloat16 CPU tensors
    (docs/decisions.md, "greedy tokens by max, not argmax")."""
    return logits.max(-1).indices


def target_rows(
    target_logits: torch.Tensor,
    predicted_from: torch.Tensor,
    head_index: torch.Tensor | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's soft labels for a drafter's rows: (log-probabilities [r, V'] over the draft head's
    vocabulary, float32; the target's top-1 [r] as a head row, IGNORE outside the head).

    ``target_logits`` [n, V] are the target's next-token logits over the sequence and
    ``predicted_from`` [r] the position each row's token follows. Each distinct position is reduced
    once and then copied to its rows: rows share positions (DART's prefix and mask rows, overlapping
    blocks), and gathering [r, V] logits before reducing cost more than the drafter's forward.
    ``head_index`` maps target ids to head rows and ``draft_vocab`` head rows to target ids (both
    None for a full-vocabulary head; on the logits' device).
    """
    used, inverse = predicted_from.unique(return_inverse=True)
    logits = target_logits[used]
    greedy = top_one(logits)
    if head_index is not None:
        greedy = head_index[greedy]
    if draft_vocab is not None:
        logits = logits[:, draft_vocab.to(logits.device)]
    return logits.float().log_softmax(-1)[inverse], greedy[inverse]


def draft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor,
    weights_by_position: torch.Tensor,
    target_logits: torch.Tensor | None,
    predicted_from: torch.Tensor | None,
    head_index: torch.Tensor | None,
    draft_vocab: torch.Tensor | None,
    row_sequence: torch.Tensor | None = None,
    sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, hits, agreements, counts) of a drafter's labelled rows, for every family's objective.

    ``target_logits`` [n, V] are the target's own next-token logits over the sequence and
    ``predicted_from`` [r] the position each row's token follows (None: cross-entropy on ``labels``,
    agreements zero); ``head_index`` and ``draft_vocab`` as in :func:`target_rows`; several
    sequences' rows as in :func:`block_loss` (their logits flattened to [b * L, V], ``predicted_from``
    indexing that).
    """
    if target_logits is None:
        loss, hits, counts = block_loss(
            logits, labels, positions, weights_by_position, None, row_sequence, sequences
        )
        return loss, hits, torch.zeros_like(hits), counts
    log_probs, greedy = target_rows(target_logits, predicted_from, head_index, draft_vocab)
    loss, hits, counts = block_loss(
        logits, labels, positions, weights_by_position, log_probs, row_sequence, sequences
    )
    return loss, hits, position_hits(logits, greedy, positions, weights_by_position.shape[0]), counts
