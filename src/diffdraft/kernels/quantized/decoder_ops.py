"""The decoder layers of a Llama-family target on Q4_1 blocks, with the work between matmuls fused.

Between its matmuls a layer runs some sixty small torch ops (norms, rotary, cache layout, attention and
its transposes, gating), and on a CPU a one-token forward spends as long on their dispatch and Python
as on the weights. ``decoder_ops.cpp`` does each step as one op: the same math in float32, rounded to
bfloat16 where Hugging Face's modules round. The block-quantized matmul already sums in another order
than the dense model, so this path is not bit-identical to Hugging Face's; it is deterministic and
batch-invariant instead: every op computes a token's rows on their own, and attention sums only the
keys a token sees, in cache order, so a tree node's hidden states are those of the same token decoded
after its path alone. Dense targets keep :class:`~diffdraft.kernels.lean_forward.LeanForward`'s own loop.

Gemma 3 text targets run here too, with their own loop (:meth:`FusedDecoderLayers.build`): Gemma's
RMSNorm (the float32 row times ``1 + weight``, rounded once), per-head q/k norms before the rotary,
norms on the attention's and the MLP's outputs before each residual add, GELU (tanh) gating, each
layer's rotary table and mask by its type, and sliding-window layers reading only the cache rows from
:func:`~diffdraft.kernels.attention_window.window_start` on: the first their queries can see, the mask
hiding the rest of what the window hides (a lone token without a mask sees exactly the rows from
there), so a windowed layer too sums exactly the keys a token sees, in cache order.

The loop over the layers runs in C++ too (``decoder_loop.cpp``: the same ops in the same order, so the
same bits) when every projection is on the int8 kernel and the caches take the forward's rows in place;
nine op calls a layer from Python had been a large share of a one-token forward (docs/decisions.md,
"the layer loop in one op").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from diffdraft.kernels.attention_window import FULL, SLIDING, LayerWindows, Mask, layer_mask, window_start
from diffdraft.kernels.fused_projections import StackedProjection, stacked_projection
from diffdraft.kernels.kv_cache import SharedBuffer, shared_buffer
from diffdraft.kernels.quantized.block_linear import has_block_layers, int8_operands
from diffdraft.kernels.quantized.kernel_build import block_kernel
from diffdraft.kernels.segment import Segment

MAX_HEAD_DIM = 256
"""The attention op's widest head (``kMaxPairs`` pairs of 32 lanes in decoder_ops.cpp)."""
Norm = tuple[torch.Tensor, float]
"""An RMSNorm's weight and epsilon."""
RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm"}
"""Norms computing Hugging Face's Llama RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps))."""
GEMMA_LAYERS = {"Gemma3DecoderLayer"}
"""Decoder layers of Gemma 3's text model, which :class:`FusedDecoderLayers` runs with its Gemma loop."""
GEMMA_NORMS = {"Gemma3RMSNorm"}
"""Norms computing Gemma's RMSNorm: bf16(float32(x * rsqrt(mean(x^2) + eps)) * (1 + float32(weight)))."""


def decoder_ops() -> object | None:
    """``torch.ops.diffdraft_decoder`` (built with the Q4_1 kernel), or None where that cannot run."""
    return None if block_kernel() is None else torch.ops.diffdraft_decoder


@dataclass
class _Layer:
    """What one decoder layer's fused forward reads from the model, looked up once (``nn.Module``
    attribute lookups are slow Python, paid per layer and forward otherwise)."""

    qkv: nn.Module
    output: nn.Module
    post_norm: Norm
    gate_up: nn.Module
    down: nn.Module
    next_norm: Norm
    """The next layer's input norm, or the decoder's final norm: each layer ends with it."""
    cache_index: int
    scaling: float
    layer_type: str = FULL
    window: int = 0
    """The sliding window's keys (0: full attention; Llama and Qwen2 layers here are all full)."""


@dataclass
class _GemmaLayer:
    """:class:`_Layer` for a Gemma 3 layer: its per-head norms, four norms and its attention type."""

    qkv: nn.Module
    output: nn.Module
    gate_up: nn.Module
    down: nn.Module
    query_norm: torch.Tensor
    key_norm: torch.Tensor
    head_eps: float
    norms: tuple[Norm, Norm, Norm, Norm]
    """Post-attention, pre-feedforward, post-feedforward, and the next layer's input norm or the final
    norm, in the order a layer applies them (:class:`LayerStack`'s too)."""
    cache_index: int
    scaling: float
    layer_type: str
    kind: int
    """The index of :attr:`layer_type` in :attr:`FusedDecoderLayers.kinds`."""
    window: int
    """The sliding window's keys (0: full attention)."""


def norm_weights(module: nn.Module) -> Norm:
    """An RMSNorm module's weight and epsilon, as the fused ops take them."""
    return module.weight, module.variance_epsilon


def gemma_norm_weights(module: nn.Module) -> Norm:
    """A Gemma RMSNorm's weight as the fused ops take it: ``1 + weight`` in float32, which tells them the
    norm is Gemma's (the sum Gemma's forward computes, made once), and its epsilon."""
    return (1.0 + module.weight.float()).contiguous(), module.eps


def _is_gemma(layers: Sequence[nn.Module]) -> bool:
    return bool(layers) and all(type(layer).__name__ in GEMMA_LAYERS for layer in layers)


class FusedDecoderLayers:
    """The decoder layers' forward over ``[n, hidden]`` bfloat16 rows; build with :meth:`build`."""

    def __init__(self, model: PreTrainedModel, layers: Sequence[nn.Module], qkv: Sequence[StackedProjection]):
        self.ops = decoder_ops()
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.get_decoder().norm]
        self.gemma = _is_gemma(layers)
        """Whether the layers are Gemma 3's, run by :meth:`_gemma_layers`."""
        self.kinds: list[str] = [FULL]
        """The layer types, in the order of ``decode_gemma_layers``' rotary tables and masks."""
        if self.gemma:
            self._init_gemma(model, layers, norms)
            return
        self.first_norm = norm_weights(layers[0].input_layernorm)
        self.layers = [
            _Layer(
                stacked.linear,
                layer.self_attn.o_proj,
                norm_weights(layer.post_attention_layernorm),
                layer.mlp.gate_proj.stacked.linear,
                layer.mlp.down_proj,
                norm_weights(next_norm),
                layer.self_attn.layer_idx,
                layer.self_attn.scaling,
            )
            for layer, stacked, next_norm in zip(layers, qkv, norms, strict=True)
        ]
        self.stack = LayerStack.of(self.first_norm, self.layers)
        """The layers as ``decode_layers`` takes them; None where a projection is not on the int8 kernel."""
        self.cache_layers = [layer.cache_index for layer in self.layers]

    @classmethod
    def build(
        cls, model: PreTrainedModel, layers: Sequence[nn.Module], qkv: Sequence[StackedProjection | None]
    ) -> FusedDecoderLayers | None:
        """The fused layers for a bfloat16 target on block-quantized layers whose q|k|v and gate|up
        projections are stacked (:mod:`diffdraft.kernels.fused_projections`), with SiLU gating and the Llama
        RMSNorm (Qwen3's per-head norms keep the eager path), or Gemma 3's layers (``qkv`` unread: their
        q/k norms stand between the projection and the rotation, and the stack is looked up here); None
        for any other model."""
        if model.dtype != torch.bfloat16 or not has_block_layers(model) or decoder_ops() is None:
            return None
        if _is_gemma(layers):
            return cls._build_gemma(model, layers)
        if getattr(model.config, "hidden_act", None) != "silu" or any(stacked is None for stacked in qkv):
            return None
        if any(layer.self_attn.head_dim > MAX_HEAD_DIM or layer.self_attn.head_dim % 2 for layer in layers):
            return None
        norms = [model.get_decoder().norm]
        norms += [
            norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        if not all(type(norm).__name__ in RMS_NORMS for norm in norms):
            return None
        if any(stacked_projection(layer.mlp.gate_proj, layer.mlp.up_proj) is None for layer in layers):
            return None
        return cls(model, layers, qkv)

    @classmethod
    def _build_gemma(cls, model: PreTrainedModel, layers: Sequence[nn.Module]) -> FusedDecoderLayers | None:
        """:meth:`build` for Gemma 3's layers: GELU (tanh) gating, no attention soft-capping, causal
        attention, Gemma norms everywhere, q|k|v and gate|up stacked."""
        config = model.config
        if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
            return None
        if getattr(config, "attn_logit_softcapping", None) is not None:
            return None
        if getattr(config, "use_bidirectional_attention", False):
            return None
        for layer in layers:
            attention = layer.self_attn
            if attention.head_dim > MAX_HEAD_DIM or attention.head_dim % 2:
                return None
            if stacked_projection(attention.q_proj, attention.k_proj, attention.v_proj) is None:
                return None
            if stacked_projection(layer.mlp.gate_proj, layer.mlp.up_proj) is None:
                return None
        norms = [model.get_decoder().norm]
        for layer in layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        if not all(type(norm).__name__ in GEMMA_NORMS for norm in norms):
            return None
        return cls(model, layers, [None] * len(layers))

    def _init_gemma(self, model: PreTrainedModel, layers: Sequence[nn.Module], next_norms: list) -> None:
        """:meth:`__init__` for Gemma 3's layers: each layer's q|k|v stack is looked up here."""
        windows = LayerWindows.of(model.config)
        types = [windows.types[layer.self_attn.layer_idx] for layer in layers]  # as the target's masks
        self.kinds = sorted(set(types))
        self.first_norm = gemma_norm_weights(layers[0].input_layernorm)
        self.layers = []
        for layer, layer_type, next_norm in zip(layers, types, next_norms, strict=True):
            attention = layer.self_attn
            stacked = stacked_projection(attention.q_proj, attention.k_proj, attention.v_proj)
            query_norm, head_eps = gemma_norm_weights(attention.q_norm)
            key_norm, _ = gemma_norm_weights(attention.k_norm)
            norms = (
                layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
                next_norm,
            )
            self.layers.append(
                _GemmaLayer(
                    stacked.linear,
                    attention.o_proj,
                    layer.mlp.gate_proj.stacked.linear,
                    layer.mlp.down_proj,
                    query_norm,
                    key_norm,
                    head_eps,
                    tuple(gemma_norm_weights(norm) for norm in norms),
                    attention.layer_idx,
                    attention.scaling,
                    layer_type,
                    self.kinds.index(layer_type),
                    windows.window if layer_type == SLIDING else 0,
                )
            )
        self.stack = LayerStack.of(self.first_norm, self.layers)
        self.cache_layers = [layer.cache_index for layer in self.layers]
        self.head_norms = (
            [layer.query_norm for layer in self.layers],
            [layer.key_norm for layer in self.layers],
            [layer.head_eps for layer in self.layers],
        )
        self.layer_kinds = [layer.kind for layer in self.layers]
        self.windows = [layer.window for layer in self.layers]

    def __call__(
        self,
        hidden: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        segments: Sequence[Segment],
        rows: Sequence[slice],
        tapped: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [n, H] after the final norm, the outputs of layers ``tapped`` (ascending) stacked
        [n, len(tapped), H], None for none), from the embeddings [n, H] and the rotary (cos, sin),
        each [1, n, head_dim], of each layer type (:mod:`diffdraft.kernels.attention_window`);
        ``rows``: each segment's tokens among the n."""
        if self.gemma:
            return self._gemma_layers(hidden, rotary, segments, rows, tapped)
        ops = self.ops
        cos, sin = (part[0] for part in rotary[FULL])
        writes = _CacheWrites.reserve(segments)
        if writes is not None and self.stack is not None:
            return self._looped(hidden, cos, sin, writes, tapped)
        normed = ops.rms_norm(hidden, *self.first_norm)
        wanted, taps = set(tapped), []
        for index, layer in enumerate(self.layers):
            query, key, value = ops.rotary_split(
                layer.qkv.forward(normed), cos, sin, self.heads, self.kv_heads
            )
            if writes is not None:
                attended = writes.attend(ops, layer, query, key, value)
            else:
                attended = self._attend(layer, query, key, value, segments, rows)
            hidden, normed = ops.residual_rms_norm(hidden, layer.output.forward(attended), *layer.post_norm)
            gated = ops.silu_gate(layer.gate_up.forward(normed))
            hidden, normed = ops.residual_rms_norm(hidden, layer.down.forward(gated), *layer.next_norm)
            if index in wanted:
                taps.append(hidden)
        if writes is not None:
            writes.commit()
        return normed, torch.stack(taps, dim=1) if taps else None

    def _looped(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        writes: _CacheWrites,
        tapped: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`__call__`'s loop as one op (``decode_layers``)."""
        stack = self.stack
        normed, *taps = self.ops.decode_layers(
            hidden,
            cos,
            sin,
            *stack.projections_and_norms(),
            self.heads,
            self.kv_heads,
            stack.scalings,
            writes.tensors,
            self.cache_layers,
            writes.starts,
            writes.counts,
            writes.masks,
            tapped,
        )
        writes.commit()
        return normed, taps[0] if taps else None

    def _gemma_layers(
        self,
        hidden: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        segments: Sequence[Segment],
        rows: Sequence[slice],
        tapped: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`__call__` for Gemma 3's layers (``decode_gemma_layers`` in one op where it can)."""
        ops = self.ops
        tables = [tuple(part[0] for part in rotary[kind]) for kind in self.kinds]
        writes = _CacheWrites.reserve(segments)
        if writes is not None and self.stack is not None:
            stack = self.stack
            masks = [mask for kind in self.kinds for mask in writes.masks_of(kind)]
            normed, *taps = ops.decode_gemma_layers(
                hidden,
                [cos for cos, _ in tables],
                [sin for _, sin in tables],
                self.layer_kinds,
                *stack.projections_and_norms(),
                *self.head_norms,
                self.heads,
                self.kv_heads,
                stack.scalings,
                self.windows,
                writes.tensors,
                self.cache_layers,
                writes.starts,
                writes.counts,
                masks,
                tapped,
            )
            writes.commit()
            return normed, taps[0] if taps else None
        normed = ops.rms_norm(hidden, *self.first_norm)
        wanted, taps = set(tapped), []
        for index, layer in enumerate(self.layers):
            cos, sin = tables[layer.kind]
            query, key, value = ops.rotary_split(
                layer.qkv.forward(normed),
                cos,
                sin,
                self.heads,
                self.kv_heads,
                layer.query_norm,
                layer.key_norm,
                layer.head_eps,
            )
            if writes is not None:
                attended = writes.attend(ops, layer, query, key, value)
            else:
                attended = self._attend(layer, query, key, value, segments, rows)
            post_attention, pre_feedforward, post_feedforward, next_norm = layer.norms
            attended = layer.output.forward(attended)
            hidden, normed = ops.normed_residual_rms_norm(hidden, attended, *post_attention, *pre_feedforward)
            gated = ops.gelu_tanh_gate(layer.gate_up.forward(normed))
            hidden, normed = ops.normed_residual_rms_norm(
                hidden, layer.down.forward(gated), *post_feedforward, *next_norm
            )
            if index in wanted:
                taps.append(hidden)
        if writes is not None:
            writes.commit()
        return normed, torch.stack(taps, dim=1) if taps else None

    def _attend(
        self,
        layer: _Layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        segments: Sequence[Segment],
        rows: Sequence[slice],
    ) -> torch.Tensor:
        """Each segment's queries over its own cache, after appending its keys and values to it, through
        the cache's own ``update`` (a cache without a started shared buffer: its first forward), under
        the segment's mask for the layer's type."""
        outputs = []
        for segment, part in zip(segments, rows, strict=True):
            keys, values = segment.cache.update(key[:, :, part], value[:, :, part], layer.cache_index)
            mask = layer_mask(segment.mask, layer.layer_type)
            if layer.window:  # the rows before the first any query sees are left out, as attend_cached does
                skipped = window_start(keys.shape[2] - segment.length, layer.window)
                keys, values = keys[:, :, skipped:], values[:, :, skipped:]
                mask = None if mask is None else mask[..., skipped:]
            outputs.append(self.ops.attention(query[part], keys, values, mask, layer.scaling))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


@dataclass
class LayerStack:
    """Decoder layers' weights, norms and attention scalings flattened once, as the ops of
    ``decoder_loop.cpp`` take them: four linears a layer (q|k|v, output, gate|up, down), and the first
    input norm then two norms a layer (post-attention, and the next layer's input or the final one), or
    a Gemma layer's four (:attr:`_GemmaLayer.norms`)."""

    weights: list[torch.Tensor]
    out_features: list[int]
    formats: list[int]
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    epsilons: list[float]
    scalings: list[float]

    @classmethod
    def of(cls, first_norm: Norm, layers: Sequence) -> LayerStack | None:
        """From layers with the fields of :class:`_Layer` (``qkv``, ``output``, ``gate_up``, ``down``,
        ``post_norm``, ``next_norm``, ``scaling``) or :class:`_GemmaLayer`'s (its four ``norms`` instead);
        None when a projection is not on the int8 kernel."""
        projections = [p for layer in layers for p in (layer.qkv, layer.output, layer.gate_up, layer.down)]
        operands = [int8_operands(p) for p in projections]
        if any(o is None for o in operands):
            return None
        weights, out_features, formats, biases = (list(part) for part in zip(*operands, strict=True))
        norms = [first_norm, *(norm for layer in layers for norm in _stack_norms(layer))]
        return cls(
            weights,
            out_features,
            formats,
            biases,
            [weight for weight, _ in norms],
            [eps for _, eps in norms],
            [layer.scaling for layer in layers],
        )

    def projections_and_norms(self) -> tuple[list, ...]:
        """The ops' first arguments after the rows and rotary, in their order."""
        return self.weights, self.out_features, self.formats, self.biases, self.norms, self.epsilons


def _stack_norms(layer) -> tuple[Norm, ...]:
    """A layer's norms after its input norm, in the order it applies them."""
    return layer.norms if isinstance(layer, _GemmaLayer) else (layer.post_norm, layer.next_norm)


@dataclass
class _CacheWrites:
    """Where a forward's layers write each segment's keys and values: every segment's shared cache
    buffer, room made for its tokens, so one ``attend_cached`` call a layer appends and attends for
    all segments. A cache ``update`` and an attention call per segment and layer (views, copies and a
    parallel region each) had cost more than the attention's arithmetic at batch 8 (docs/decisions.md,
    "one cache-and-attention op a layer")."""

    buffers: list[SharedBuffer]
    tensors: list[torch.Tensor]
    starts: list[int]
    counts: list[int]
    masks: list[Mask | None]

    @classmethod
    def reserve(cls, segments: Sequence[Segment]) -> _CacheWrites | None:
        """None when a segment's cache keeps no started shared buffer."""
        buffers, starts = [], []
        for segment in segments:
            buffer = shared_buffer(segment.cache)
            start = buffer.reserve(segment.length) if buffer is not None else None
            if start is None:
                return None
            buffers.append(buffer)
            starts.append(start)
        tensors = [buffer.tensor for buffer in buffers]  # after every reserve: growing replaces a tensor
        counts = [segment.length for segment in segments]
        return cls(buffers, tensors, starts, counts, [segment.mask for segment in segments])

    def attend(
        self, ops, layer: _Layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Append ``layer``'s keys and values to every segment's cache and attend each segment's
        queries over its own: :meth:`FusedDecoderLayers._attend` in one op."""
        places = (self.tensors, layer.cache_index, self.starts, self.counts, self.masks_of(layer.layer_type))
        return ops.attend_cached(query, key, value, *places, layer.scaling, layer.window)

    def masks_of(self, layer_type: str) -> list[torch.Tensor | None]:
        """Every segment's mask for layers of ``layer_type`` (a hybrid target's masks are by type)."""
        if all(not isinstance(mask, dict) for mask in self.masks):
            return self.masks
        return [layer_mask(mask, layer_type) for mask in self.masks]

    def commit(self) -> None:
        """Count the written rows in every layer of every segment's cache."""
        for buffer, count in zip(self.buffers, self.counts, strict=True):
            buffer.extend(count)
