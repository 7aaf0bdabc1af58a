"""The DFlash2 draft network, in the layout vLLM loads (``architectures: ["DFlash2DraftModel"]``).

DFlash's network (context from the tapped target layers, bidirectional block attention over
``[context ; block]``) with two additions:

* each layer wraps its attention and its MLP in a :class:`~diffdraft.drafters.block_conv.BlockConv`
  (``attention_conv``, ``mlp_conv``): the sublayer reads its convolved input, and its output is
  convolved again before it joins the residual stream; context rows are not convolved;
* the draft distributions come from a :class:`~diffdraft.drafters.candidate_selector.CandidateSelector`
  over the head's top ``selector_top_k`` tokens per position, each position scored after the token
  drafted before it (:class:`~diffdraft.drafters.candidate_selector.SelectorConditionals`).

Settings (``dflash_config``): ``block_size``, ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``, ``mask_token_id``, ``target_layer_ids``; optional
``input_embedding_scale`` (block embeddings are multiplied by it), ``output_multiplier`` and
``final_logit_softcapping`` (the candidates' head logits are multiplied, then soft-capped).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import Qwen3Config

from diffdraft.drafters.block_conv import BlockConv
from diffdraft.drafters.candidate_selector import CandidateSelector, SelectorConditionals
from diffdraft.drafters.dflash_model import (
    DFLASH,
    DFlashDraftModel,
    DraftLayer,
    dflash_config_from,
    draft_setting,
    make_draft_config,
    refuse_unrun_settings,
)

DFLASH2 = "dflash2"
ARCHITECTURE = "DFlash2DraftModel"
SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The ``dflash_config`` settings DFlash2 adds to DFlash's."""


def is_dflash2_config(raw: dict) -> bool:
    """Whether a raw ``config.json`` is a DFlash2 drafter's."""
    return ARCHITECTURE in (raw.get("architectures") or [])


def dflash2_config_from(raw: dict) -> Qwen3Config:
    """The config of a DFlash2 ``config.json``; raises ValueError when a setting is missing."""
    config = dflash_config_from(raw)
    refuse_unrun_settings(config)
    missing = [key for key in SETTINGS if draft_setting(config, key) is None]
    if missing:
        raise ValueError(f"it lacks dflash_config.{', '.join(missing)}, which DFlash2 drafters record")
    if draft_setting(config, "draft_vocab_size"):
        raise ValueError("a DFlash2 drafter scores the whole vocabulary; it takes no draft_vocab_size")
    return config


class DFlash2Layer(DraftLayer):
    """A DFlash layer whose attention and MLP each sit between the two halves of a block conv."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, DFLASH)
        taps, group_size = (int(draft_setting(config, key)) for key in SETTINGS[:2])
        self.attention_conv = BlockConv(config.hidden_size, taps, group_size)
        self.mlp_conv = BlockConv(config.hidden_size, taps, group_size)

    def forward(self, x, cos, sin, context_kv, attention_mask):
        h, offsets = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context_kv, attention_mask), offsets)
        h, offsets = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), offsets)


class DFlash2DraftModel(DFlashDraftModel):
    """See the module docstring."""

    runs_fused: ClassVar[bool] = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        rank, top_k = (int(draft_setting(config, key)) for key in SETTINGS[2:])
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, rank, top_k)
        self.input_embedding_scale = float(draft_setting(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(draft_setting(config, "output_multiplier", 1.0))
        self.softcap = float(draft_setting(config, "final_logit_softcapping", 0.0) or 0.0)

    def _variant(self, config: Qwen3Config) -> str:
        return DFLASH2

    def _layer(self, config: Qwen3Config) -> nn.Module:
        return DFlash2Layer(config)

    def forward(
        self,
        block_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DFlash's forward over the block embeddings times ``input_embedding_scale``."""
        return super().forward(
            block_embeds * self.input_embedding_scale, position_ids, context_kv, attention_mask
        )

    def unary_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits as the selector scores them: times ``output_multiplier``, then soft-capped.
        Both keep the logits' order, so the top-K candidates are the raw logits' own."""
        scores = logits * self.output_multiplier
        return torch.tanh(scores / self.softcap) * self.softcap if self.softcap > 0 else scores

    def draft_conditionals(self, hidden: torch.Tensor, head: nn.Module) -> list[SelectorConditionals]:
        """Each batch row's distributions after any predecessor, from the drafted rows' hidden states
        [b, depth, H]: the head's top-K candidates and their unary scores, and the projected states,
        computed once for every predecessor a tree or a sampled chain meets."""
        logits = head(hidden).float()
        unary, candidates = logits.topk(self.candidate_selector.top_k, dim=-1)
        unary = self.unary_scores(unary)
        projected = self.candidate_selector.hidden_projection(hidden)
        width = logits.shape[-1]
        return [
            SelectorConditionals(self.candidate_selector, projected[row], candidates[row], unary[row], width)
            for row in range(hidden.shape[0])
        ]

    def draft_log_probs(self, hidden: torch.Tensor, head: nn.Module, roots: torch.Tensor) -> torch.Tensor:
        """Each position's log-probabilities over its top-K head tokens after the greedy chain's
        previous token (every other token -inf), as [b, depth, V]: the rows vLLM's greedy walk reads."""
        rows = self.draft_conditionals(hidden, head)
        return torch.stack([row.greedy_rows(root) for row, root in zip(rows, roots, strict=True)])


def make_dflash2_config(
    target_config,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    conv_kernel_size: int = 3,
    conv_group_size: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 8,
) -> Qwen3Config:
    """A DFlash2 config sized to ``target_config``, in the layout vLLM reads (for random-weight
    drafters that check this loader, and vLLM against it)."""
    config = make_draft_config(target_config, num_layers, block_size, mask_token_id, target_layer_ids)
    config.architectures = [ARCHITECTURE]
    config.dflash_config = {
        "block_size": block_size,
        "conv_kernel_size": conv_kernel_size,
        "conv_group_size": conv_group_size,
        "selector_rank": selector_rank,
        "selector_top_k": selector_top_k,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    return config
