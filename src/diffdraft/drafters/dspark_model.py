"""The Qwen3 DSpark draft network, in the layout vLLM loads (``architectures: ["Qwen3DSparkModel"]``,
or ``["DSparkDraftModel"]`` with ``model_type: "qwen3"``).

DFlash's network (context from the tapped target layers, bidirectional block attention) with two
changes:

* the anchor row predicts too (``sample_from_anchor``, true unless the config says otherwise): a
  block of ``block_size`` rows ``[anchor, noise x (block_size - 1)]`` drafts ``block_size`` tokens,
  row ``i`` the token after position ``i`` (the noise token is ``dspark_noise_token_id`` unless a
  mask token is recorded); with ``sample_from_anchor`` false the block is DFlash's;
* a low-rank Markov head adds a bias to each position's logits from the token chosen just before it:
  ``logit_scale * (head(h_l) + markov_w2 @ markov_w1[previous token])``, position 0's previous token
  being the anchor. So a position's distribution depends on the token chosen before it
  (:class:`MarkovConditionals` scores it after any predecessor). ``dspark_draft_topk`` (optional)
  keeps only each position's top-k head logits.

A reduced draft vocabulary (``draft_vocab_size`` below ``vocab_size``) comes with its own ``lm_head``
and ``d2t`` (draft id ``j`` is target id ``j + d2t[j]``); over the whole vocabulary the target's LM
head scores, unless the checkpoint ships an ``lm_head`` of its own (its config does not say: vLLM
tells by the weights, and so does :meth:`DSparkDraftModel.use_shipped_head`).
``markov_w1`` is indexed by target ids, ``markov_w2`` scores the draft vocabulary. The optional
``confidence_head`` (a per-position acceptance estimate) is loaded but drafting does not read it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import Qwen3Config

from diffdraft.drafters.conditionals import Conditionals
from diffdraft.drafters.dflash_model import (
    DFlashDraftModel,
    dflash_config_from,
    make_draft_config,
    refuse_unrun_settings,
)

DSPARK = "dspark"
ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")


def is_dspark_config(raw: dict) -> bool:
    """Whether a raw ``config.json`` is a Qwen3 DSpark drafter's (DeepSeek's ``DSparkDraftModel``
    without ``model_type: "qwen3"`` is another network)."""
    names = raw.get("architectures") or []
    return ARCHITECTURES[0] in names or (ARCHITECTURES[1] in names and raw.get("model_type") == "qwen3")


def dspark_config_from(raw: dict) -> Qwen3Config:
    """The config of a DSpark ``config.json``; raises ValueError when a setting is missing."""
    config = dflash_config_from(raw)
    refuse_unrun_settings(config)
    if not getattr(config, "markov_rank", None):
        raise ValueError("it lacks markov_rank, which DSpark drafters record")
    if getattr(config, "markov_head_type", "vanilla") != "vanilla":
        raise ValueError(
            f"markov_head_type {config.markov_head_type!r} is not the vanilla head diffdraft runs"
        )
    return config


class MarkovHead(nn.Module):
    """The bias a previous token adds to the next position's draft-vocabulary logits (rank r)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class MarkovConditionals(Conditionals):
    """One DSpark proposal's rows: ``logit_scale * (head logits + markov_w2 @ markov_w1[previous])``,
    log-softmaxed over the draft vocabulary, or over each position's kept top-k head logits (the
    Markov term then computed for those columns only)."""

    def __init__(
        self,
        logits: torch.Tensor,
        kept: torch.Tensor | None,
        markov: MarkovHead,
        logit_scale: float,
        vocab: torch.Tensor | None,
        width: int,
    ) -> None:
        """``logits`` [d, w] float32: the head's logits, or where ``kept`` [d, k] (columns) is given,
        the kept ones; ``vocab``: the draft vocabulary's target ids (None: the whole vocabulary's),
        ``width`` columns."""
        self.logits, self.kept, self.markov, self.logit_scale = logits, kept, markov, logit_scale
        self.vocab, self.width = vocab, width

    @property
    def depth(self) -> int:
        return int(self.logits.shape[0])

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @torch.inference_mode()
    def rows(self, position: int, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kept is None:
            bias, columns = self.markov(previous).float(), None
        else:
            columns = self.kept[position]
            bias = (self.markov.markov_w1(previous) @ self.markov.markov_w2.weight[columns].T).float()
        return (self.logit_scale * (self.logits[position] + bias)).log_softmax(-1), columns


class ConfidenceHead(nn.Module):
    """DSpark's acceptance estimate, kept so its checkpoints load unchanged; drafting never reads it."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)


class DSparkDraftModel(DFlashDraftModel):
    """See the module docstring."""

    runs_fused: ClassVar[bool] = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.anchor_rows = 0 if getattr(config, "sample_from_anchor", True) else 1
        rank = int(config.markov_rank)
        self.markov_head = MarkovHead(config.vocab_size, self._draft_vocab_size, rank)
        if getattr(config, "enable_confidence_head", False):
            extra = rank if getattr(config, "confidence_head_with_markov", False) else 0
            self.confidence_head = ConfidenceHead(config.hidden_size + extra)
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))
        self.draft_top_k = getattr(config, "dspark_draft_topk", None)

    def _variant(self, config: Qwen3Config) -> str:
        return DSPARK

    def _register_draft_vocab(self, config: Qwen3Config) -> None:
        """A reduced vocabulary's own head and ``d2t`` offsets; none for the whole vocabulary."""
        self._draft_vocab_size = min(
            getattr(config, "draft_vocab_size", None) or config.vocab_size, config.vocab_size
        )
        if self._draft_vocab_size < config.vocab_size:
            self.lm_head = nn.Linear(config.hidden_size, self._draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self._draft_vocab_size, dtype=torch.long))

    def use_shipped_head(self, names: set[str]) -> None:
        """Before a checkpoint's weights (``names``) load: a whole-vocabulary drafter that ships an
        ``lm_head`` scores with it instead of the target's, as in vLLM."""
        if self.lm_head is None and "lm_head.weight" in names:
            like = self.norm.weight
            self.lm_head = nn.Linear(
                self.config.hidden_size,
                self._draft_vocab_size,
                bias=False,
                dtype=like.dtype,
                device=like.device,
            )

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The target id of each draft id (None: the whole vocabulary)."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(self._draft_vocab_size, device=d2t.device) + d2t

    def draft_conditionals(self, hidden: torch.Tensor, head: nn.Module) -> list[MarkovConditionals]:
        """Each batch row's distributions after any predecessor, from the drafted rows' hidden states
        [b, depth, H]: the head's logits (its top-k where ``dspark_draft_topk`` is set), computed once
        for every predecessor a tree or a sampled chain meets."""
        logits = head(hidden).float()
        width, kept = logits.shape[-1], None
        if self.draft_top_k is not None and self.draft_top_k < width:
            logits, kept = logits.topk(self.draft_top_k, dim=-1)
        vocab, markov, scale = self.draft_vocab, self.markov_head, self.logit_scale
        return [
            MarkovConditionals(logits[row], None if kept is None else kept[row], markov, scale, vocab, width)
            for row in range(hidden.shape[0])
        ]

    def draft_log_probs(self, hidden: torch.Tensor, head: nn.Module, roots: torch.Tensor) -> torch.Tensor:
        """Each position's log-probabilities over the draft vocabulary after the greedy chain's
        previous token, as [b, depth, draft vocabulary]: the rows vLLM's greedy walk reads."""
        rows = self.draft_conditionals(hidden, head)
        return torch.stack([row.greedy_rows(root) for row, root in zip(rows, roots, strict=True)])


def make_dspark_config(
    target_config,
    num_layers: int,
    block_size: int,
    noise_token_id: int,
    target_layer_ids: list[int],
    markov_rank: int = 8,
    draft_vocab_size: int | None = None,
    confidence_head: bool = False,
) -> Qwen3Config:
    """A Qwen3 DSpark config sized to ``target_config``, in the layout vLLM reads (for random-weight
    drafters that check this loader, and vLLM against it); ``draft_vocab_size`` below the target's
    vocabulary gives the drafter its own head and ``d2t``."""
    config = make_draft_config(target_config, num_layers, block_size, noise_token_id, target_layer_ids)
    del config.dflash_config, config.num_target_layers
    config.architectures = [ARCHITECTURES[0]]
    config.target_layer_ids = list(target_layer_ids)
    config.dspark_noise_token_id = noise_token_id
    config.markov_rank = markov_rank
    config.markov_head_type = "vanilla"
    config.draft_vocab_size = draft_vocab_size or target_config.vocab_size
    config.enable_confidence_head = confidence_head
    config.confidence_head_with_markov = confidence_head
    return config
