"""The training objective of Qwen3 DSpark drafters: DFlash's anchored blocks, every row drafting, the
Markov head fed the true previous token, and the loss the public DSpark trainers use.

Sources (read for their facts; docs/training.md, "DFlash2 and DSpark"): vLLM speculators' DSpark
metrics (``speculators/models/dspark/metrics.py``) and a Qwen3 DSpark reproduction adapted from NVIDIA
NeMo AutoModel (``GodHu777777/qwen3-dspark``, ``losses.py`` / ``config.py``). Both train the
Markov-corrected logits ``head(h) + markov_w2 @ markov_w1[previous]`` with the previous token teacher
forced (the anchor for row 0), weight block row ``k`` (depth ``k + 1``) by ``exp(-k / gamma)``,
gamma 4, and add a confidence head's binary cross-entropy against the detached acceptance rate
``sum_v min(p_v, q_v) = 1 - TV(p, q)``. The reproduction's divergence is ``0.1 CE + 0.9 L1`` (L1 =
``sum_v |p_v - q_v|``); here the CE term is diffdraft's own (KL to the target's distribution with
``--labels target``, cross-entropy on the tokens with ``--labels tokens``, where ``p`` is the token's
one-hot distribution).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from diffdraft.drafters.dflash_model import DEFAULT_TAP_COUNT, DFLASH, default_target_layer_ids, draft_head
from diffdraft.drafters.dspark_model import DSparkDraftModel, make_dspark_config
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch
from diffdraft.train.blocks import IGNORE, drafted_states
from diffdraft.train.config import TrainConfig
from diffdraft.train.dflash_objective import head_rows, start_layers
from diffdraft.train.loss import (
    mean_of_sequences,
    position_counts,
    position_hits,
    position_weights,
    row_losses,
    target_rows,
)
from diffdraft.train.recipe import TrainingRecipe

CE_WEIGHT = 0.1
"""Weight of the cross-entropy (or KL) term: the public reproduction's ``ce_alpha``."""
L1_WEIGHT = 0.9
"""Weight of ``sum_v |p_v - q_v|`` (twice the total variation): the reproduction's ``l1_alpha``. TV is
what greedy and sampled acceptance follow, so most of the loss sits on it."""
CONFIDENCE_WEIGHT = 1.0
"""Weight of the confidence head's binary cross-entropy (speculators' ``confidence_head_alpha``)."""


class MarkovObjective(nn.Module):
    """DSpark drafter + the target's frozen embedding (and head, when the drafter has none of its own)
    -> (loss, hits, agreements, counts) of a batch, the last three per depth [max_depth + 1]."""

    def __init__(self, drafter: DSparkDraftModel, target_model: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.frozen = [target_model.get_input_embeddings()]
        if drafter.lm_head is None:  # its own head (a reduced vocabulary's) trains with it
            self.frozen.append(draft_head(target_model.get_output_embeddings(), drafter.draft_vocab))
        vocab = drafter.draft_vocab
        self.label_index = None if vocab is None else head_rows(target_model.config.vocab_size, vocab)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head logits [r, draft vocabulary] of hidden states [r, H], in the hidden states' dtype."""
        head = self.drafter.lm_head if self.drafter.lm_head is not None else self.frozen[1]
        bias = None if head.bias is None else head.bias.to(hidden.dtype)
        return F.linear(hidden, head.weight.to(hidden.dtype), bias)

    def forward(
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every anchored block of every sequence in one drafter forward; each drafting row's Markov
        bias is that of the true token before the one it drafts. Returns (loss, hits, agreements,
        counts): hits and agreements of the Markov-corrected top-1 (what greedy drafting picks once
        the tokens before it are accepted) with the text and with the target's own top-1."""
        drafter, embed = self.drafter, self.frozen[0]
        depths = drafter.max_depth + 1
        device = batch.taps.device
        sequences, context = batch.token_ids.shape
        drafted = drafted_states(drafter, embed, batch)
        sequence, depth, position, tokens = drafted.sequence, drafted.depth, drafted.position, drafted.tokens
        previous = tokens[sequence, position - 1]
        states = drafted.states
        logits = drafter.logit_scale * (self.head(states).float() + drafter.markov_head(previous).float())
        labels = tokens[sequence, position]
        if self.label_index is not None:
            labels = self.label_index[labels]
        weights = position_weights(depths, gamma).to(device)[depth]
        draft_probs = logits.softmax(-1)
        if batch.target_logits is None:
            weights = weights * (labels != IGNORE)
            divergence = row_losses(logits, labels, None)
            acceptance = draft_probs.gather(-1, labels.clamp_min(0)[:, None])[:, 0]
            greedy = None
        else:
            predicted_from = sequence * context + position - 1
            log_probs, greedy = target_rows(
                batch.target_logits.flatten(0, 1), predicted_from, self.label_index, drafter.draft_vocab
            )
            divergence = row_losses(logits, labels, log_probs)
            acceptance = torch.minimum(log_probs.exp(), draft_probs).sum(-1)
        per_row = CE_WEIGHT * divergence + L1_WEIGHT * 2 * (1 - acceptance)
        confidence = self._confidence_logits(states, previous)
        if confidence is not None:
            target = acceptance.detach().clamp(0, 1)
            per_row = per_row + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(
                confidence, target, reduction="none"
            )
        loss = mean_of_sequences(per_row * weights, weights, sequence, sequences)
        hits = position_hits(logits, labels, depth, depths)
        agreements = (
            torch.zeros_like(hits) if greedy is None else position_hits(logits, greedy, depth, depths)
        )
        return loss, hits, agreements, position_counts(depth, depths)

    def _confidence_logits(self, states: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logits [r] (None without one): it reads the row's hidden state and,
        where its config says so, the previous token's Markov embedding, as vLLM's does."""
        head = getattr(self.drafter, "confidence_head", None)
        if head is None:
            return None
        inputs = states
        if getattr(self.drafter.config, "confidence_head_with_markov", False):
            inputs = torch.cat([states, self.drafter.markov_head.markov_w1(previous).to(states.dtype)], -1)
        return head.proj(inputs.to(head.proj.weight.dtype)).float()[:, 0]


def new_dspark_drafter(
    config: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None
) -> DSparkDraftModel:
    """A fresh Qwen3 DSpark drafter for ``target`` in the layout vLLM loads: whole vocabulary through
    the target's head, the anchor row drafting, ``--markov-rank``, a confidence head (with the Markov
    embedding, as the public checkpoints ship it). Layers start as DFlash's do; the Markov and
    confidence heads at the small normal init of the reproduction, so the first logits are DFlash's."""
    if draft_vocab is not None:
        raise ValueError("a new DSpark drafter scores the whole vocabulary")  # TrainConfig refuses it first
    layer_ids = config.target_layer_ids or default_target_layer_ids(
        target.config.num_hidden_layers, DEFAULT_TAP_COUNT[DFLASH]
    )
    draft_config = make_dspark_config(
        target.config,
        num_layers=config.num_layers,
        block_size=config.block_size,
        noise_token_id=config.mask_token_id,
        target_layer_ids=layer_ids,
        markov_rank=config.markov_rank,
        confidence_head=True,
    )
    if config.intermediate_size:
        draft_config.intermediate_size = config.intermediate_size
    drafter = DSparkDraftModel(draft_config)
    std = draft_config.initializer_range
    with torch.no_grad():
        nn.init.normal_(drafter.markov_head.markov_w1.weight, std=std)
        nn.init.normal_(drafter.markov_head.markov_w2.weight, std=std)
        nn.init.normal_(drafter.confidence_head.proj.weight, std=std)
        nn.init.zeros_(drafter.confidence_head.proj.bias)
    return start_layers(drafter, config, target)


RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: MarkovObjective(drafter, target_model),
    new_model=new_dspark_drafter,
    gamma_0=4.0,
    fixed_gamma=True,
)
"""DSpark's recipe: ``exp(-(d-1)/gamma)`` per depth d (``exp(-k/gamma)`` per block row), gamma 4 fixed."""
