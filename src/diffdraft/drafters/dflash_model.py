"""The DFlash / DFlare block-diffusion draft network.

A few Qwen3-style layers whose queries come from one block (``[anchor, MASK x (B-1)]``) and whose
keys/values are ``[context ; block]``: the context rows are projected target hidden states, so
every draft layer is conditioned on the target. Attention inside the block is bidirectional.

* DFlash: context = ``hidden_norm(fc(concat(T target layers)))``, shared by all draft layers,
  projected by each layer's own ``k_proj`` / ``v_proj``.
* DFlare (``dflash_config.variant == "dflare"``): draft layer ``i`` gets
  ``context_norm_i(sum_j softmax(fusion.weight[i])_j * h_j)`` and projects it with separate
  ``context_k_proj`` / ``context_v_proj`` (DFlare paper, Eq. 3-4). No ``fc``.

Weight names follow the official DFlash checkpoint layout, so official checkpoints load unchanged.
The network has no embedding and no LM head: it borrows the target's (frozen).

Optional draft vocabulary (``dflash_config.draft_vocab_size``, our extension): the drafter scores
only the K target tokens in its ``draft_vocab`` buffer, the rows of the borrowed LM head that the
target actually emits (EAGLE-3 and FR-Spec shrink the draft head the same way). The LM head and
softmax over the full vocabulary dominate a small drafter's cost, in training and at inference;
verification stays exact because the target still scores every token.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from diffdraft.drafters.conditionals import Conditionals
from diffdraft.drafters.target_rope import drafter_rope

DFLASH = "dflash"
DFLARE = "dflare"


def draft_setting(config: Qwen3Config, name: str, default: object = None) -> object:
    """Read a DFlash setting from ``dflash_config`` first, then the top level (both layouts exist)."""
    nested = getattr(config, "dflash_config", None) or {}
    return nested.get(name, getattr(config, name, default))


def mask_token_setting(config: Qwen3Config) -> object:
    """The id of the token that fills a block's drafted rows, where the layouts other engines load
    keep it: ``dflash_config.mask_token_id``, else a top-level ``mask_token_id``, else DSpark's
    ``dspark_noise_token_id`` (vLLM looks in the same order); None when none is recorded."""
    token = draft_setting(config, "mask_token_id")
    return getattr(config, "dspark_noise_token_id", None) if token is None else token


def dflash_config_from(raw: dict) -> Qwen3Config:
    """The config of a DFlash / DFlare ``config.json`` (and of the DFlash2 and DSpark layouts, which
    build on it); raises ValueError when it lacks a setting the drafter cannot do without (a wrong
    layer id raises no error later, it only lowers acceptance)."""
    config = Qwen3Config(**raw)
    settings = {
        "mask_token_id": mask_token_setting(config),
        "target_layer_ids": draft_setting(config, "target_layer_ids"),
    }
    for key, value in settings.items():
        if value is None:
            raise ValueError(
                f"it lacks dflash_config.{key}; DFlash drafters must record it "
                "(target_layer_ids count DFlash-style: id i = output of target layer i)"
            )
    return config


def refuse_unrun_settings(config: Qwen3Config) -> None:
    """Raise ValueError for a backbone setting vLLM honours and this network does not run (causal or
    sliding-window layers, attention sinks, a value scale, interleaved rotary, context without
    ``fc``): ignored, it would draft other distributions without a word."""
    nested = getattr(config, "dflash_config", None) or {}
    found = [
        name
        for name, unrun in (
            ("causal", getattr(config, "is_causal", None) or nested.get("causal")),
            ("use_swa", nested.get("use_swa")),
            ("sliding_attention layers", "sliding_attention" in (getattr(config, "layer_types", None) or [])),
            (
                "attention_sink_bias",
                nested.get("attention_sink_bias") or getattr(config, "add_swa_attention_sink_bias", False),
            ),
            ("attention_value_scale", nested.get("attention_value_scale") is not None),
            ("is_neox_style: false", getattr(config, "is_neox_style", True) is False),
            ("use_aux_hidden_state: false", draft_setting(config, "use_aux_hidden_state", True) is False),
        )
        if unrun
    ]
    if found:
        raise ValueError(f"it sets {', '.join(found)}, which diffdraft's DFlash backbone does not run")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for x [b, heads, n, d] with cos/sin [b, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config, separate_context_kv: bool) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        if separate_context_kv:
            self.context_k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            self.context_v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        else:
            self.context_k_proj = self.context_v_proj = None

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], heads, self.head_dim)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [b, kv_heads, n, d] for block or context rows."""
        k_proj = self.context_k_proj if context and self.context_k_proj is not None else self.k_proj
        v_proj = self.context_v_proj if context and self.context_v_proj is not None else self.v_proj
        k = self.k_norm(self._heads(k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(v_proj(x), self.num_kv_heads).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        q = _rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2), cos, sin)
        k, v = self.project_kv(x, cos, sin, context=False)
        k = torch.cat([context_kv[0], k], dim=2)
        v = torch.cat([context_kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class DraftLayer(nn.Module):
    """One draft decoder layer: attention over ``[context ; block]``, then the MLP, each pre-normed
    and added to the residual stream."""

    def __init__(self, config: Qwen3Config, variant: str) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, separate_context_kv=variant == DFLARE)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.context_norm = (
            Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if variant == DFLARE else None
        )

    def forward(self, x, cos, sin, context_kv, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The draft network; see the module docstring for the two variants.

    The DFlash2 and DSpark layouts (:mod:`~diffdraft.drafters.dflash2_model`,
    :mod:`~diffdraft.drafters.dspark_model`) are subclasses: their own layers (:meth:`_layer`), their
    own draft distributions (:meth:`draft_log_probs`, :meth:`draft_conditionals`) over DFlash's
    context and block attention.
    """

    runs_fused: ClassVar[bool] = True
    """Whether its layers are plain DFlash / DFlare layers, which the fused decoder ops and the packed
    layout beside an inference-only target run (the subclasses' layers are not)."""
    anchor_rows: int = 1
    """Rows at the head of a block that draft nothing: DFlash's anchor row only conditions the block
    (its masks sit at the drafted positions); DSpark's anchor row predicts the first drafted token."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.variant = self._variant(config)
        self.target_layer_ids: list[int] = list(draft_setting(config, "target_layer_ids"))
        self.block_size = int(draft_setting(config, "block_size", 16))
        self.mask_token_id = int(mask_token_setting(config))
        self.lm_head: nn.Module | None = None
        """A head of its own (a reduced-vocabulary DSpark ships one); None borrows the target's."""
        self._register_draft_vocab(config)
        num_taps = len(self.target_layer_ids)
        self.layers = nn.ModuleList(self._layer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if self.variant != DFLARE:
            self.fc = nn.Linear(num_taps * config.hidden_size, config.hidden_size, bias=False)
            self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.fusion = nn.Linear(num_taps, config.num_hidden_layers, bias=False)
        self.reset_parameters()

    def _variant(self, config: Qwen3Config) -> str:
        """The variant its config names (``dflash_config.variant``); raises ValueError for another."""
        variant = str(draft_setting(config, "variant", DFLASH))
        if variant not in (DFLASH, DFLARE):
            raise ValueError(f"unknown drafter variant {variant!r}; expected {DFLASH!r} or {DFLARE!r}")
        return variant

    def _layer(self, config: Qwen3Config) -> nn.Module:
        """One draft layer of its variant."""
        return DraftLayer(config, self.variant)

    def _register_draft_vocab(self, config: Qwen3Config) -> None:
        """The ``draft_vocab`` buffer (our extension, ``dflash_config.draft_vocab_size``), or None."""
        draft_vocab_size = int(draft_setting(config, "draft_vocab_size", 0) or 0)
        self.draft_vocab: torch.Tensor | None
        if draft_vocab_size:
            self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None

    def reset_parameters(self) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        if self.variant == DFLARE:
            nn.init.zeros_(self.fusion.weight)  # start from a uniform average of the tapped layers

    @property
    def max_depth(self) -> int:
        """Drafted positions per forward: the block's rows that draft."""
        return self.block_size - self.anchor_rows

    def block_rows(self, depth: int) -> int:
        """Query rows of a block that drafts ``depth`` positions (the anchor row at least)."""
        return max(depth + self.anchor_rows, 1)

    def draft_log_probs(self, hidden: torch.Tensor, head: nn.Module, roots: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [b, depth, head's vocabulary] from the drafting rows' hidden states
        [b, depth, H]. DFlash's positions are independent: the head's softmax at each row. ``roots``
        [b] (each block's anchor token) is for the subclasses whose distribution at a position depends
        on the token chosen before it: theirs are the rows along the greedy chain."""
        return head(hidden).float().log_softmax(-1)

    def draft_conditionals(self, hidden: torch.Tensor, head: nn.Module) -> list[Conditionals] | None:
        """Where a position's distribution depends on the token chosen before it (the subclasses):
        each batch row's distributions after any predecessor, from the drafting rows' hidden states
        [b, depth, H]. None: DFlash's positions are independent, and :meth:`draft_log_probs` is all."""
        return None

    def rope(self, position_ids: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, position_ids)

    def context_features(self, taps: torch.Tensor) -> list[torch.Tensor]:
        """Per-draft-layer context rows [b, c, H] from target taps [b, c, T, H]."""
        if self.variant != DFLARE:
            shared = self.hidden_norm(self.fc(taps.flatten(-2)))
            return [shared] * len(self.layers)
        weights = self.fusion.weight.softmax(-1).to(taps.dtype)  # [layers, T]
        return [
            layer.context_norm(torch.matmul(w, taps))  # [T] @ [b, c, T, H]: the weighted sum over taps
            for layer, w in zip(self.layers, weights, strict=True)
        ]

    def context_kv(
        self, taps: torch.Tensor, position_ids: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys/values of context rows for every draft layer; cacheable, they never change."""
        features = self.context_features(taps)
        cos, sin = self.rope(position_ids, features[0])
        return [
            layer.self_attn.project_kv(f, cos, sin, context=True)
            for layer, f in zip(self.layers, features, strict=True)
        ]

    def forward(
        self,
        block_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [b, q, H] (final-normed) for block rows; the target's LM head makes logits.

        Without a mask every block row sees every context row and the whole block (inference);
        training passes a block-sparse mask over ``[context ; blocks]``.
        """
        cos, sin = self.rope(position_ids, block_embeds)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, kv, attention_mask)
        return self.norm(x)


def draft_head(lm_head: nn.Module, draft_vocab: torch.Tensor | None) -> nn.Module:
    """The target's LM head restricted to ``draft_vocab`` rows (the head itself when None); frozen."""
    if draft_vocab is None:
        return lm_head
    weight = lm_head.weight.detach()
    bias = getattr(lm_head, "bias", None)
    rows = draft_vocab.to(weight.device)
    head = nn.Linear(
        weight.shape[1], rows.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    head.weight = nn.Parameter(weight[rows], requires_grad=False)
    if bias is not None:
        head.bias = nn.Parameter(bias.detach()[rows], requires_grad=False)
    return head


DEFAULT_TAP_COUNT = {DFLASH: 5, DFLARE: 9}
"""Target layers a new drafter taps, whatever its own depth, so a shallow drafter still sees the target
from shallow to deep: the official Qwen3 DFlash drafters tap 5 ([1, 9, 17, 25, 33] of 36); DFlare
fuses 9 (the shipped default's, of SmolLM2's 30)."""


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """Up to ``count`` distinct layer ids spread evenly from layer 1 to layer L-3 (shallow to deep, as
    DFlash picks); one tap, or a target too shallow for two, gets the middle layer."""
    first, last = 1, num_target_layers - 3
    count = min(count, last - first + 1)
    if count <= 1:
        return [num_target_layers // 2]
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


def make_draft_config(
    target_config,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    variant: str = DFLASH,
    intermediate_size: int | None = None,
    draft_vocab_size: int = 0,
) -> Qwen3Config:
    """A fresh drafter config sized to ``target_config`` (hidden size, heads, vocab, rope).

    ``draft_vocab_size`` > 0 gives the model a ``draft_vocab`` buffer to fill before training.
    """
    num_target_layers = target_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, DEFAULT_TAP_COUNT[variant])
    heads = target_config.num_attention_heads
    return Qwen3Config(
        architectures=["DFlareDraftModel" if variant == DFLARE else "DFlashDraftModel"],
        hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=drafter_rope(target_config),
        attention_bias=False,
        tie_word_embeddings=False,
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "variant": variant,
            **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}),
        },
    )
