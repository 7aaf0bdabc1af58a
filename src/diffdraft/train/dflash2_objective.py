"""The training objective of DFlash2 drafters: DFlash's block loss on the head's logits plus the
candidate selector's cross-entropy over its top-K candidates after the true previous token.

No public DFlash2 trainer or paper states its loss (docs/training.md, "DFlash2 and DSpark"), so this
is the natural one for what the network drafts. A position's draft distribution is the softmax of
the selector's scores over the head's top ``selector_top_k`` tokens, every other token at 0. Two
things must hold for it to be right: the token the target wants must be among the candidates, and
the selector must rank it first. The first term trains the head's full-vocabulary logits as DFlash's
objective does (KL to the target with ``--labels target``, cross-entropy on the tokens with
``--labels tokens``; position k of a block weighted ``exp(-(k-1)/gamma)``, gamma rising 1 per epoch
from 4.5), which pulls that token into the top-K. The second trains the selector's scores of the
top-K candidates (their unary logits plus the codebooks' bilinear term) after the token before the
drafted one: the target's distribution renormalised over the candidates (``--labels target``), or
the token itself where it is a candidate (``--labels tokens``), with the same position weights.
The previous token is the true one (teacher forcing), as DSpark's public trainers condition their
Markov head: at inference each drafted token's successors are scored after that drafted token,
which is the true one whenever the tokens before it are accepted, and acceptance is all that counts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from diffdraft.drafters.dflash2_model import DFlash2DraftModel, make_dflash2_config
from diffdraft.drafters.dflash_model import DEFAULT_TAP_COUNT, DFLASH, default_target_layer_ids
from diffdraft.errors import InvalidRequestError
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch
from diffdraft.train.blocks import drafted_states
from diffdraft.train.config import TrainConfig
from diffdraft.train.dflash_objective import start_layers
from diffdraft.train.loss import block_loss, mean_of_sequences, position_weights, target_rows
from diffdraft.train.recipe import TrainingRecipe

SELECTOR_WEIGHT = 1.0
"""Weight of the selector's cross-entropy beside the head's block loss: both are per-row
cross-entropies of the same scale, and neither alone makes the draft distribution right."""


class SelectorObjective(nn.Module):
    """DFlash2 drafter + the target's frozen embedding and LM head -> (loss, hits, agreements, counts)
    of a batch, the last three per block position [block_size]."""

    def __init__(self, drafter: DFlash2DraftModel, target_model: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.frozen = [target_model.get_input_embeddings(), target_model.get_output_embeddings()]

    def forward(
        self, batch: TrainingBatch, gamma: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every anchored block of every sequence in one drafter forward. Hits and agreements are those
        of the selector's top candidate after the true previous token (what greedy drafting picks once
        the tokens before it are accepted), with the text and with the target's own top-1."""
        drafter = self.drafter
        embed, lm_head = self.frozen
        block_size = drafter.block_size
        device, dtype = batch.taps.device, drafter.norm.weight.dtype
        sequences, context = batch.token_ids.shape
        drafted = drafted_states(drafter, embed, batch)
        sequence, depth, position, tokens = drafted.sequence, drafted.depth, drafted.position, drafted.tokens
        labels, previous = tokens[sequence, position], tokens[sequence, position - 1]
        states = drafted.states
        bias = None if lm_head.bias is None else lm_head.bias.to(dtype)
        unary = drafter.unary_scores(F.linear(states, lm_head.weight.to(dtype), bias).float())
        weights_by_position = position_weights(block_size, gamma)
        log_probs = greedy = None
        if batch.target_logits is not None:
            log_probs, greedy = target_rows(
                batch.target_logits.flatten(0, 1), sequence * context + position - 1
            )
        head_loss, _, counts = block_loss(
            unary, labels, depth, weights_by_position, log_probs, sequence, sequences
        )
        selector = drafter.candidate_selector
        candidates = unary.detach().topk(selector.top_k, dim=-1).indices
        scores = selector.scores_after(states, candidates, unary.gather(-1, candidates), previous)
        weights = weights_by_position.to(device)[depth]
        if log_probs is None:
            is_label = candidates == labels[:, None]
            weights = weights * is_label.any(-1)  # a label outside the candidates: the head's term's job
            per_row = F.cross_entropy(scores, is_label.float().argmax(-1), reduction="none")
        else:
            wanted = log_probs.gather(-1, candidates).log_softmax(-1).exp()
            per_row = -(wanted * scores.log_softmax(-1)).sum(-1)
        selector_loss = mean_of_sequences(per_row * weights, weights, sequence, sequences)
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
        hits = _by_position(chosen == labels, depth, block_size)
        agreements = (
            torch.zeros_like(hits) if greedy is None else _by_position(chosen == greedy, depth, block_size)
        )
        return head_loss + SELECTOR_WEIGHT * selector_loss, hits, agreements, counts


def _by_position(matches: torch.Tensor, depth: torch.Tensor, size: int) -> torch.Tensor:
    """[size] how many rows at each depth match."""
    return torch.zeros(size, device=matches.device).index_add_(0, depth, matches.float())


def new_dflash2_drafter(
    config: TrainConfig, target: TargetModel, draft_vocab: torch.Tensor | None
) -> DFlash2DraftModel:
    """A fresh DFlash2 drafter for ``target`` in the layout vLLM loads (whole vocabulary through the
    target's head). Its layers start as DFlash's do, and its block convolutions as the identity (the
    kernel projections at zero), so it starts as the DFlash network it extends."""
    if draft_vocab is not None:
        raise ValueError("a new DFlash2 drafter scores the whole vocabulary")  # TrainConfig refuses it first
    hidden = target.config.hidden_size
    if hidden % config.conv_group_size:
        raise InvalidRequestError(
            f"--conv-group-size {config.conv_group_size} must divide the target's hidden size {hidden}: "
            f"pick one of {[size for size in (4, 8, 16, 32, 64) if hidden % size == 0]}"
        )
    if config.selector_top_k > target.vocab_size:
        raise InvalidRequestError(
            f"--selector-top-k {config.selector_top_k} exceeds the target's vocabulary "
            f"({target.vocab_size}): lower it"
        )
    layer_ids = config.target_layer_ids or default_target_layer_ids(
        target.config.num_hidden_layers, DEFAULT_TAP_COUNT[DFLASH]
    )
    draft_config = make_dflash2_config(
        target.config,
        num_layers=config.num_layers,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=layer_ids,
        conv_kernel_size=config.conv_kernel_size,
        conv_group_size=config.conv_group_size,
        selector_rank=config.selector_rank,
        selector_top_k=config.selector_top_k,
    )
    if config.intermediate_size:
        draft_config.intermediate_size = config.intermediate_size
    drafter = DFlash2DraftModel(draft_config)
    with torch.no_grad():
        for layer in drafter.layers:
            nn.init.zeros_(layer.attention_conv.kernel_projection.weight)
            nn.init.zeros_(layer.mlp_conv.kernel_projection.weight)
        nn.init.normal_(
            drafter.candidate_selector.hidden_projection.weight, std=draft_config.initializer_range
        )
    return start_layers(drafter, config, target)


RECIPE = TrainingRecipe(
    objective=lambda drafter, target_model, stage, max_suffix: SelectorObjective(drafter, target_model),
    new_model=new_dflash2_drafter,
    gamma_0=4.5,
    fixed_gamma=False,
)
"""DFlash2's recipe: DFlash's weighting exp(-(k-1)/gamma), gamma rising 1 per epoch from 4.5."""
