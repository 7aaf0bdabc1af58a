"""The DFlash / DFlare draft layers' inference forward through the fused decoder ops.

Beside a bfloat16 target on diffdraft's CPU kernels the drafter's projections are laid out on the same
kernels, and an 8-row block's matmuls then take about as long as the two dozen small torch ops a
layer runs between them (Qwen3's per-head norms, rotary, context and block keys concatenated,
attention, gating). Here each of those steps is one op of
:mod:`~diffdraft.kernels.quantized.decoder_ops`, rounded where the module forward rounds; attention
sums in another order, so a proposal may differ from the module forward's in the last bits. Drafts
only: verification keeps the output exact whatever the drafter proposes. One block's loop over the
layers runs as one op on the int8 kernel (``draft_layers`` in ``decoder_loop.cpp``, the same bits), so
does the projection of committed tokens into the context (``draft_context``), and a whole drafting
round of one sequence, both and the LM head (``draft_block``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from diffdraft.drafters.dflash_model import DFLASH, DFlashDraftModel
from diffdraft.drafters.draft_context import DraftContext, KeysAndValues
from diffdraft.kernels.fused_projections import stacked_projection
from diffdraft.kernels.quantized.block_linear import int8_operands
from diffdraft.kernels.quantized.decoder_ops import MAX_HEAD_DIM, LayerStack, Norm, decoder_ops, norm_weights


@dataclass
class _Layer:
    """What one draft layer's fused forward reads, looked up once (module attribute lookups are slow)."""

    qkv: nn.Module
    context_kv: nn.Module
    """Projects context rows: DFlare's own k|v projection; DFlash's q|k|v, the queries dropped."""
    context_heads: int
    """Query heads in ``context_kv``'s output (DFlash: all of them, unused; DFlare: none)."""
    head_norms: tuple[torch.Tensor, torch.Tensor, float]
    output: nn.Module
    post_norm: Norm
    gate_up: nn.Module
    down: nn.Module
    next_norm: Norm
    """The next layer's input norm, or the model's final norm: each layer ends with it."""
    scaling: float


@dataclass(frozen=True)
class _ContextStack:
    """The context projection's operands in the order of ``draft_context`` and ``draft_block``."""

    features: tuple
    """DFlare's tap weights or DFlash's fc (weight, output width, format), then the context norms and
    their epsilons."""
    linears: tuple
    """Every layer's context k|v linear: weights, output widths, formats, biases; the query heads
    they project first (DFlash: all, dropped; DFlare: none)."""


@dataclass(frozen=True)
class DraftBlock:
    """What one drafting round of :meth:`FusedDraftLayers.draft_block` drafts from."""

    root: int
    """The round's root token (the block's first row)."""
    depth: int
    """Positions drafted after it (mask tokens)."""
    taps: torch.Tensor | None
    """Committed tokens' target taps [c, T, H] not yet in the context."""
    mask_token: int
    embedding: torch.Tensor
    """The target's token embedding table."""
    lm_head: tuple
    """The LM head over the draft vocabulary, as its int8 kernel operands (weight, width, format, bias)."""


class FusedDraftLayers:
    """The draft network's block forward and context projection; build with :meth:`build`."""

    def __init__(self, model: DFlashDraftModel) -> None:
        self.ops = decoder_ops()
        attention = model.layers[0].self_attn
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        next_norms = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
        self.first_norm = norm_weights(model.layers[0].input_layernorm)
        self.layers = [
            _layer(layer, next_norm, model.variant)
            for layer, next_norm in zip(model.layers, next_norms, strict=True)
        ]
        if model.variant == DFLASH:
            self.fc, self.hidden_norm = model.fc, norm_weights(model.hidden_norm)
        else:  # DFlare's per-layer mix of the taps, its softmax taken once; mixed in float32 (a CPU
            # without native bfloat16 matmuls is far slower in bfloat16: docs/decisions.md, "DFlare's
            # tap mix in float32"), then rounded as a bfloat16 matmul rounds its float32 sums
            self.tap_weights = model.fusion.weight.float().softmax(-1).to(torch.bfloat16).float()
            self.context_norms = [norm_weights(layer.context_norm) for layer in model.layers]
        self.variant = model.variant
        self.stack = LayerStack.of(self.first_norm, self.layers)
        """The layers as ``draft_layers`` (decoder_loop.cpp) takes them, which runs one block's forward
        in one op; None where a projection is not on the int8 kernel."""
        self.head_norms = tuple(
            list(part) for part in zip(*(layer.head_norms for layer in self.layers), strict=True)
        )
        """Every layer's query norm weight, key norm weight and epsilon, three lists as ``draft_layers``
        takes them (made once: the op runs every drafting round)."""
        self.context_stack = self._context_stack()
        """The context projection's operands as ``draft_context`` and ``draft_block`` take them
        (decoder_loop.cpp), which project committed tokens' taps into every layer's context rows in one
        op; None where a linear is not on the int8 kernel."""

    @classmethod
    def build(cls, model: DFlashDraftModel) -> FusedDraftLayers | None:
        """The fused layers of a bfloat16 drafter whose q|k|v and gate|up projections are stacked
        (laid out beside an inference-only target) where the decoder ops run; None otherwise."""
        if model.norm.weight.dtype != torch.bfloat16 or getattr(model.config, "hidden_act", None) != "silu":
            return None
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if attention.head_dim > MAX_HEAD_DIM or attention.head_dim % 2:
                return None
            qkv = stacked_projection(attention.q_proj, attention.k_proj, attention.v_proj)
            if qkv is None or stacked_projection(mlp.gate_proj, mlp.up_proj) is None:
                return None
        # last: the first call loads (or compiles) the kernel library, which a drafter not laid out
        # on it has no use for
        return cls(model) if decoder_ops() is not None else None

    def _context_stack(self) -> _ContextStack | None:
        """None where a context linear (or DFlash's fc) is not on the int8 kernel."""
        context_kv = [int8_operands(layer.context_kv) for layer in self.layers]
        fc = int8_operands(self.fc) if self.variant == DFLASH else None
        fc_off_kernel = self.variant == DFLASH and (fc is None or fc[3] is not None)  # fc: never a bias
        if fc_off_kernel or any(o is None for o in context_kv):
            return None
        if self.variant == DFLASH:
            features = (None, *fc[:3], [self.hidden_norm[0]], [self.hidden_norm[1]])
        else:
            norms = self.context_norms
            features = (self.tap_weights, None, 0, 0, [w for w, _ in norms], [eps for _, eps in norms])
        weights, out_features, formats, biases = (list(part) for part in zip(*context_kv, strict=True))
        return _ContextStack(features, (weights, out_features, formats, biases, self.layers[0].context_heads))

    def project(
        self, taps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: DraftContext
    ) -> None:
        """Append the context rows of committed tokens' target taps [c, T, H] to ``context``, ``cos`` /
        ``sin`` [c, d] the rows' rotary: :meth:`context_features` then :meth:`context_kv`, in one op
        (``draft_context``, the same bits) once the context holds rows."""
        if self.context_stack is None or not context.length:
            context.append(self.context_kv(self.context_features(taps), cos, sin))
            return
        stack = self.context_stack
        keys, values = context.block_room(taps.shape[0])
        linears = (*stack.linears, self.kv_heads, *self.head_norms)
        self.ops.draft_context(taps, *stack.features, cos, sin, *linears, keys, values, context.length)
        context.count_appended(taps.shape[0])

    def drafts_in_one_op(self) -> bool:
        """Whether :meth:`draft_block` runs here (every linear on the int8 kernel)."""
        return self.stack is not None and self.context_stack is not None

    def draft_block(
        self, block: DraftBlock, context: DraftContext, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """A whole drafting round of one sequence in one op (``draft_block``): ``block.taps`` (committed
        tokens' taps [c, T, H] not yet in ``context``, or None) appended to ``context`` as :meth:`project`
        does, then the block's forward as :meth:`__call__` does, then the LM head: float32
        log-probabilities [depth, vocabulary] of the drafted rows. ``cos`` / ``sin``: the rotary of the
        c taps' rows then the block's. The context must hold rows already."""
        appended = 0 if block.taps is None else block.taps.shape[0]
        keys, values = context.block_room(appended + block.depth + 1)
        stack = self.context_stack
        log_probs = self.ops.draft_block(
            block.root,
            block.mask_token,
            block.depth,
            block.embedding,
            cos,
            sin,
            block.taps,
            *stack.features,
            *stack.linears,
            *self._layer_operands(),
            *block.lm_head,
            keys,
            values,
            context.length,
        )
        context.count_appended(appended)
        return log_probs

    def context_features(self, taps: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's context rows [c, H] from target taps [c, T, H], as
        :meth:`~diffdraft.drafters.dflash_model.DFlashDraftModel.context_features` makes them."""
        if self.variant == DFLASH:
            shared = self.ops.rms_norm(self.fc.forward(taps.flatten(-2)), *self.hidden_norm)
            return [shared] * len(self.layers)
        rows, taps_count, hidden = taps.shape
        # one matmul mixes every layer's taps
        by_tap = taps.transpose(0, 1).reshape(taps_count, rows * hidden).float()
        mixed = torch.matmul(self.tap_weights, by_tap).to(taps.dtype).view(len(self.layers), rows, hidden)
        return [self.ops.rms_norm(m, *norm) for m, norm in zip(mixed, self.context_norms, strict=True)]

    def context_kv(
        self, features: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> list[KeysAndValues]:
        """Every layer's keys (normed, rotated) and values [1, kv_heads, c, d] of context rows, from
        the layers' context features, each [c, H], and the rows' rotary (cos, sin), each [c, d]."""
        keys_and_values = []
        for layer, rows in zip(self.layers, features, strict=True):
            projected = layer.context_kv.forward(rows)
            _, keys, values = self.ops.rotary_split(
                projected, cos, sin, layer.context_heads, self.kv_heads, *layer.head_norms
            )
            keys_and_values.append((keys, values))
        return keys_and_values

    def __call__(
        self,
        blocks: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        contexts: Sequence[DraftContext],
        rows: Sequence[slice],
    ) -> torch.Tensor:
        """Final-normed hidden states [n, H] of blocks' embeddings [n, H]: ``rows`` are each block's
        among the n, and its rows see the whole of its own context (of ``contexts``) and block.
        ``cos``/``sin`` [n, d]: the rows' rotary. The projections run over every row at once;
        attention per block, over its own context, so each block's rows are those it gets alone."""
        ops = self.ops
        if self.stack is not None and len(contexts) == 1 and contexts[0].length:
            return self._looped(blocks, cos, sin, contexts[0])
        hidden, normed = blocks, ops.rms_norm(blocks, *self.first_norm)
        for index, layer in enumerate(self.layers):
            query, keys, values = ops.rotary_split(
                layer.qkv.forward(normed), cos, sin, self.heads, self.kv_heads, *layer.head_norms
            )
            attended = []
            for context, part in zip(contexts, rows, strict=True):
                block_keys, block_values = context.with_block(index, keys[:, :, part], values[:, :, part])
                attended.append(ops.attention(query[part], block_keys, block_values, None, layer.scaling))
            attended = attended[0] if len(attended) == 1 else torch.cat(attended)
            hidden, normed = ops.residual_rms_norm(hidden, layer.output.forward(attended), *layer.post_norm)
            gated = ops.silu_gate(layer.gate_up.forward(normed))
            hidden, normed = ops.residual_rms_norm(hidden, layer.down.forward(gated), *layer.next_norm)
        return normed

    def _looped(
        self, block: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: DraftContext
    ) -> torch.Tensor:
        """:meth:`__call__` for one block, its loop as one op (``draft_layers``)."""
        keys, values = context.block_room(block.shape[0])
        return self.ops.draft_layers(block, cos, sin, *self._layer_operands(), keys, values, context.length)

    def _layer_operands(self) -> tuple:
        """The layers' operands as ``draft_layers`` and ``draft_block`` take them after the block's rows
        and rotary: linears, norms, per-head norms, head counts and scalings."""
        stack = self.stack
        return *stack.projections_and_norms(), *self.head_norms, self.heads, self.kv_heads, stack.scalings


def _layer(layer: nn.Module, next_norm: nn.Module, variant: str) -> _Layer:
    attention = layer.self_attn
    qkv = attention.q_proj.stacked.linear
    if variant == DFLASH:  # context rows go through the block's own k and v projections
        context_kv, context_heads = qkv, attention.num_heads
    else:
        k, v = attention.context_k_proj, attention.context_v_proj
        context_kv, context_heads = type(k).stacked([k, v]), 0
    return _Layer(
        qkv=qkv,
        context_kv=context_kv,
        context_heads=context_heads,
        head_norms=(attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.variance_epsilon),
        output=attention.o_proj,
        post_norm=norm_weights(layer.post_attention_layernorm),
        gate_up=layer.mlp.gate_proj.stacked.linear,
        down=layer.mlp.down_proj,
        next_norm=norm_weights(next_norm),
        scaling=attention.head_dim**-0.5,
    )
