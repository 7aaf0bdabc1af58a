"""The DART draft network: one decoder layer that drafts ``draft_length + 1`` positions in one pass.

Input row ``i`` of the prefix pairs the target's hidden states at position ``i`` (three tapped
layers, concatenated and projected by ``fc``: g_i) with the embedding of the *next* token
(e_{i+1}), as EAGLE-3 does; the attention input is ``[input_layernorm(e) ; hidden_norm(g)]`` (2H
wide) and the residual stream starts from g. After the prefix come ``draft_length`` mask rows, each
a learned 2H vector ``mask_rep`` (residual: its first H entries). Attention is causal over prefix +
masks. Logits are *shifted*: the last prefix row predicts the first drafted token (the one after
the row's next token), mask row j the (j + 1)-th (DART paper, Sec. 3.2).

Weight and config names follow the released DART checkpoints (fvliang/DART, ``llama3_dart.py``):
``fc``, ``midlayer.{self_attn,mlp,hidden_norm,input_layernorm,post_attention_layernorm,mask_rep}``,
``norm``, ``lm_head`` over a draft vocabulary, ``d2t`` (draft index -> target id, stored as an
offset: target id = index + d2t[index]) and ``t2d`` (which target ids the head covers); config
``draft_length``, ``draft_vocab_size``, ``target_hidden_size``. The embedding is the target's
(frozen, never saved). Like the reference, ``norm`` is applied twice before the head, so released
checkpoints give the same logits. The released code hard-codes the tapped layers (EAGLE-3's
choice); ours records them in ``dart_config.target_layer_ids`` (DFlash-style ids: id i = output
of target layer i) and falls back to that choice when absent.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from diffdraft.drafters.target_rope import drafter_rope

ARCHITECTURE = "DARTDraftModel"
DART = "dart"


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's (and DART's) taps, HF ``hidden_states[2, L // 2, L - 3]``, as DFlash-style ids."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def dart_setting(config: LlamaConfig, name: str, default: object = None) -> object:
    nested = getattr(config, "dart_config", None) or {}
    return nested.get(name, getattr(config, name, default))


def is_dart_config(raw: dict) -> bool:
    """Released DART configs name no architecture we know; their ``draft_length`` gives them away."""
    return ARCHITECTURE in (raw.get("architectures") or []) or "draft_length" in raw


def dart_config_from(raw: dict) -> LlamaConfig:
    """The config of a DART ``config.json`` (released ones are plain Llama configs plus DART's keys)."""
    return LlamaConfig(**raw)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for x [b, heads, n, d] with cos/sin [b, n, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DARTAttention(nn.Module):
    """Attention whose q/k/v read the 2H-wide ``[embedding ; target features]`` input."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], heads, self.head_dim).transpose(1, 2)

    def key_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [b, kv_heads, n, d]: cacheable, a row's input never changes."""
        k = _rope(self._heads(self.k_proj(x), self.num_kv_heads), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Queries from ``x`` [b, q, 2H] over ``kv`` (which already holds the queries' own rows)."""
        q = _rope(self._heads(self.q_proj(x), self.num_heads), cos, sin)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class DARTLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DARTAttention(config)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mask_rep = nn.Parameter(torch.zeros(2 * hidden))


class DARTDraftModel(nn.Module):
    """See the module docstring. ``max_depth`` = drafted positions per forward = draft_length + 1."""

    variant = DART
    """The drafter family, as DFlash drafters name theirs (``dflash`` / ``dflare``)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.draft_length = int(dart_setting(config, "draft_length", 7))
        self.max_depth = self.draft_length + 1
        num_target_layers = int(dart_setting(config, "num_target_layers", 0) or 0)
        ids = dart_setting(config, "target_layer_ids")
        if ids is None and not num_target_layers:
            raise ValueError("a DART config needs dart_config.target_layer_ids or num_target_layers")
        self.target_layer_ids: list[int] = (
            list(ids) if ids is not None else eagle3_layer_ids(num_target_layers)
        )
        draft_vocab_size = int(dart_setting(config, "draft_vocab_size", 0) or config.vocab_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, hidden, bias=False)
        self.midlayer = DARTLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, LlamaRMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.midlayer.mask_rep, std=std)  # random, as the paper initializes it

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[K] target token id of each head row."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Make head row i score target token ``token_ids[i]`` (ids sorted ascending, as released)."""
        ids = token_ids.to(self.d2t.device).long().sort().values
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def rope(self, position_ids: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, position_ids)

    def prefix_inputs(
        self, taps: torch.Tensor, next_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [b, n, 2H], residual [b, n, H]) of prefix rows from taps [b, n, T, Ht]
        and the embeddings of each row's next token [b, n, H]."""
        layer = self.midlayer
        g = self.fc(taps.flatten(-2))
        return torch.cat([layer.input_layernorm(next_embeds), layer.hidden_norm(g)], dim=-1), g

    def mask_inputs(self, batch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of ``count`` mask rows."""
        rep = self.midlayer.mask_rep
        x = rep.expand(batch, count, rep.shape[0])
        return x, x[..., : self.config.hidden_size]

    def key_values(
        self, inputs: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope(position_ids, inputs)
        return self.midlayer.self_attn.key_values(inputs, cos, sin)

    def forward(
        self,
        inputs: torch.Tensor,
        residual: torch.Tensor,
        position_ids: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [b, q, H] of the query rows (attention input, residual, positions) given
        keys/values ``kv`` of every row they may see, themselves included."""
        layer = self.midlayer
        cos, sin = self.rope(position_ids, inputs)
        x = residual + layer.self_attn(inputs, cos, sin, kv, attention_mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits; ``norm`` again, as the released inference code does."""
        return self.lm_head(self.norm(hidden))


def make_dart_config(
    target_config,
    draft_length: int = 7,
    target_layer_ids: list[int] | None = None,
    draft_vocab_size: int = 0,
    intermediate_size: int | None = None,
) -> LlamaConfig:
    """A fresh DART config sized to the target (the paper keeps the layer's shape the target's)."""
    heads = target_config.num_attention_heads
    num_target_layers = target_config.num_hidden_layers
    return LlamaConfig(
        architectures=[ARCHITECTURE],
        hidden_size=target_config.hidden_size,
        target_hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=drafter_rope(target_config),
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        tie_word_embeddings=False,
        draft_length=draft_length,
        draft_vocab_size=draft_vocab_size or target_config.vocab_size,
        num_target_layers=num_target_layers,
        dart_config={"target_layer_ids": list(target_layer_ids or eagle3_layer_ids(num_target_layers))},
    )
