"""The verification forward as one plain loop over the decoder layers: the same ops, less glue.

A Hugging Face forward wraps every layer and module call in hooks, keyword plumbing, output
recorders and mask preparation. On a small target on a CPU that glue is a visible share of a
verification forward (docs/decisions.md, "the verification forward as one plain loop"), and a
speculative round is mostly that forward. For the families of :data:`SUPPORTED_LAYERS` (Llama,
Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3) this loop calls the model's own module forwards and
attention function in Hugging Face's order, so the logits, taps and cache are bit-identical (the
tests compare them); other families keep Hugging Face's forward. Module hooks do not run on this path.

Sliding-window layers (:mod:`diffdraft.kernels.attention_window`) attend under their layer type's
mask and only to the cache rows from :func:`window_start` on: the rows Hugging Face's sliding cache
would hold, so the attention sums the same terms. Gemma 3's rotary has a base per layer type, and
every layer rotates with its own type's table. Targets on
Q4_1 blocks, whose matmuls already differ from Hugging Face's in rounding, run their layers through
fused CPU ops instead (:mod:`diffdraft.kernels.quantized.decoder_ops`): deterministic and
batch-invariant rather than bit-identical.
"""

from __future__ import annotations

import itertools
import sys

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    apply_rotary_pos_emb,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as apply_partial_rotary_pos_emb

from diffdraft.kernels.attention_window import FULL, LayerWindows, Mask, layer_mask, window_start
from diffdraft.kernels.fused_projections import StackedProjection, stacked_projection
from diffdraft.kernels.quantized.block_linear import kernel_rows_only
from diffdraft.kernels.quantized.decoder_ops import FusedDecoderLayers
from diffdraft.kernels.rotary_table import RotaryTable, per_layer_type
from diffdraft.kernels.segment import Segment

SUPPORTED_LAYERS = {
    "LlamaDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
    "MistralDecoderLayer",
    "Phi3DecoderLayer",
    "Gemma2DecoderLayer",
    "Gemma3DecoderLayer",
}
"""Decoder layers this loop runs: the Llama one, with Qwen3's per-head q/k norms, Phi-3's stacked
q|k|v and gate|up projections, and Gemma's sandwich norms (post-attention, pre- and post-feedforward),
Gemma 3's per-head norms after the head split and Gemma 2's attention soft-capping."""
GEMMA_LAYERS = {"Gemma2DecoderLayer", "Gemma3DecoderLayer"}
"""Layers with a norm after the attention and around the feedforward."""
FUSED_WINDOWED = {"Gemma3DecoderLayer"}
"""Windowed families :class:`FusedDecoderLayers` may take (it reads each layer type's rotary and mask);
its Llama and Qwen2 ops attend without a window, so windowed targets of those keep this loop."""


class LeanForward:
    """Runs ``model`` (a supported causal LM) over a cache with a 4D mask; see the module docstring."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = list(self.decoder.layers[: model.config.num_hidden_layers])
        self.windows = LayerWindows.of(model.config)
        """Each layer's attention type and the window of the sliding ones."""
        rotary = self.decoder.rotary_emb
        kinds = sorted(set(self.windows.types) | {FULL})
        if per_layer_type(rotary):  # Gemma 3: a base per layer type (the module has the types it uses)
            self.rotaries = {kind: RotaryTable(rotary, kind) for kind in kinds if kind in rotary.rope_type}
        else:
            self.rotary = RotaryTable(rotary)
            self.rotaries = dict.fromkeys(kinds, self.rotary)
        """Per layer type, the table its layers rotate with (one table shared where the module has one)."""
        self.stacked_qkv = [_stacked_qkv(layer.self_attn) for layer in self.layers]
        self.keywords = [_keywords(layer.self_attn) for layer in self.layers]
        """Each layer's extra attention keywords, looked up once rather than in every forward."""
        self.gemma = type(self.layers[0]).__name__ in GEMMA_LAYERS
        attention_module = sys.modules[type(self.layers[0].self_attn).__module__]
        self.eager = getattr(attention_module, "eager_attention_forward", eager_attention_forward)
        """The family's own eager attention (Gemma 2's soft-caps the scores), as its layers fall back on."""
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        """Gemma's cap on the logits: ``cap * tanh(logits / cap)``, as its causal LM's forward does."""
        self.sdpa = model.config._attn_implementation == "sdpa"
        self._everything: dict[int, torch.Tensor] = {}
        """Per window, the all-true mask of a lone token's windowed layers (:meth:`_mask`)."""
        windowed = self.windows.window is not None
        fusable = not windowed or all(type(layer).__name__ in FUSED_WINDOWED for layer in self.layers)
        self.fused = FusedDecoderLayers.build(model, self.layers, self.stacked_qkv) if fusable else None
        """The layers as fused CPU ops, for Llama, Qwen2 and Gemma 3 targets on blocks; None otherwise."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if not layers or not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")):
            return False
        if not hasattr(model, "lm_head") or getattr(decoder, "config", None) is not model.config:
            return False  # a multimodal wrapper (Gemma 3's image-text model) keeps its own forward
        if getattr(model.config, "use_bidirectional_attention", False):
            return False
        kinds = {type(layer).__name__ for layer in layers}
        return len(kinds) == 1 and kinds <= SUPPORTED_LAYERS

    def __call__(
        self,
        cache: DynamicCache,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Mask | None,
        layer_ids: list[int],
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] for every input token (the last ``logits_to_keep`` only, where given) and taps
        [n, T, H] (None when ``layer_ids`` is empty).

        ``mask`` is the additive 4D mask of :meth:`TargetModel.attention_mask` (a dict by layer type
        for a hybrid target); None only for a single token, which sees the whole cache (the last
        ``window`` rows in a windowed layer)."""
        segments = [Segment(cache, token_ids.shape[0], mask)]
        return self.packed(segments, token_ids, position_ids, layer_ids, logits_to_keep)[0]

    @kernel_rows_only()
    def packed(
        self,
        segments: list[Segment],
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        layer_ids: list[int],
        logits_to_keep: int = 0,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`__call__` for several sequences at once: ``token_ids`` / ``position_ids`` are every
        segment's, concatenated in order. Projections and MLPs run over all tokens in one matmul;
        attention runs per segment over its own cache and mask. Returns (logits, taps) per segment.
        Block-quantized layers stay on their kernel for any number of tokens (:func:`kernel_rows_only`).
        ``logits_to_keep`` (one segment only; 0: all) is how many of the last tokens get logits."""
        for segment in segments:
            if segment.mask is None and segment.length != 1:
                raise ValueError("without a mask the lean forward takes one token; give a causal mask")
        if logits_to_keep and len(segments) > 1:
            raise ValueError("logits_to_keep applies to one segment; packed segments keep every row's logits")
        hidden = self.decoder.embed_tokens.forward(token_ids[None])  # Gemma's module scales itself
        positions = position_ids[None]
        rotary = self._rotary(hidden, positions)
        rows = segment_rows(segments)
        last = len(self.layers) - 1
        tapped = sorted({i for i in layer_ids if i != last})
        if self.fused is not None:
            hidden, stacked = self.fused(hidden[0], rotary, segments, rows, tapped)
        else:
            hidden, stacked = self._layers(hidden, rotary, positions, segments, rows, tapped)
        stacked = _taps_in_order(stacked, tapped, layer_ids, hidden, last)
        logits = self.model.lm_head.forward(hidden[-logits_to_keep:][None])[0]  # [-0:]: every row
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if len(segments) == 1:
            return [(logits, stacked)]
        sizes = [segment.length for segment in segments]
        split_taps = stacked.split(sizes) if stacked is not None else [None] * len(segments)
        return list(zip(logits.split(sizes), split_taps, strict=True))

    def _rotary(
        self, like: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [1, n, head_dim] per layer type, computed once per distinct table."""
        computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        rotary = {}
        for kind, table in self.rotaries.items():
            if id(table) not in computed:
                computed[id(table)] = table(like, positions)
            rotary[kind] = computed[id(table)]
        return rotary

    def _mask(self, mask: Mask | None, kind: str, window: int | None, past: int) -> torch.Tensor | None:
        """The mask a layer of type ``kind`` attends one segment under. A lone token (``mask`` None)
        whose window is full gets what Hugging Face's SDPA path hands such a layer: an all-true
        boolean mask over the window (SDPA's CPU kernel rounds that case apart from no mask)."""
        if mask is not None or window is None or past + 1 < window or not self.sdpa:
            mask = layer_mask(mask, kind)
            start = window_start(past, window)
            return mask[..., start:] if start and mask is not None else mask
        everything = self._everything.get(window)
        if everything is None or everything.device != self.decoder.embed_tokens.weight.device:
            device = self.decoder.embed_tokens.weight.device
            everything = self._everything[window] = torch.ones(
                1, 1, 1, window, dtype=torch.bool, device=device
            )
        return everything

    def _layers(
        self,
        hidden: torch.Tensor,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        segments: list[Segment],
        rows: list[slice],
        tapped: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers through the model's own modules, in Hugging Face's order: (hidden [n, H]
        after the final norm, the outputs of layers ``tapped`` (ascending) stacked [n, len(tapped), H],
        None for none)."""
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, self.eager)
        wanted, taps = set(tapped), []
        windowed = self.windows.window is not None  # (a graphed forward's cache has no length)
        pasts = [segment.cache.get_seq_length() if windowed else 0 for segment in segments]
        layers = zip(self.layers, self.stacked_qkv, self.keywords, self.windows.types, strict=True)
        for index, (layer, stacked, keywords, kind) in enumerate(layers):
            window = self.windows.window if kind != FULL else None
            views = [
                _Visible(segment, self._mask(segment.mask, kind, window, past), window_start(past, window))
                for segment, past in zip(segments, pasts, strict=True)
            ]
            residual = hidden
            normed = layer.input_layernorm.forward(hidden)
            attended = _attention(
                layer.self_attn, stacked, normed, rotary[kind], positions, views, rows, attend, keywords
            )
            if self.gemma:
                attended = layer.post_attention_layernorm.forward(attended)
            hidden = residual + attended
            residual = hidden
            if self.gemma:
                normed = layer.pre_feedforward_layernorm.forward(hidden)
                hidden = residual + layer.post_feedforward_layernorm.forward(_mlp(layer.mlp, normed))
            else:
                normed = layer.post_attention_layernorm.forward(hidden)
                hidden = residual + _mlp(layer.mlp, normed)
            if index in wanted:
                taps.append(hidden[0])
        return self.decoder.norm.forward(hidden)[0], torch.stack(taps, dim=1) if taps else None


def _taps_in_order(
    stacked: torch.Tensor | None, tapped: list[int], layer_ids: list[int], final: torch.Tensor, last: int
) -> torch.Tensor | None:
    """The taps [n, len(layer_ids), H] in ``layer_ids``' order, from the layers ``tapped`` stacked in
    the forward (ascending, the last layer left out) and the ``final`` normed rows [n, H]: Hugging
    Face reports the last layer's output after the final norm. Ascending ids (a drafter's usual)
    take the forward's stack as it is."""
    columns = tapped
    if last in layer_ids:
        columns = [*tapped, last]
        stacked = final[:, None] if stacked is None else torch.cat([stacked, final[:, None]], dim=1)
    if layer_ids != columns:  # another order, or an id given twice (selects: a CUDA graph captures them)
        stacked = torch.stack([stacked[:, columns.index(i)] for i in layer_ids], dim=1)
    return stacked


def segment_rows(segments: list[Segment]) -> list[slice]:
    """Each segment's tokens among the packed forward's rows (all of them for a single segment)."""
    if len(segments) == 1:
        return [slice(None)]
    edges = list(itertools.accumulate((segment.length for segment in segments), initial=0))
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


class _Visible:
    """What one layer's attention reads of a segment: its cache, the first cache row it sees
    (:func:`window_start`; 0 for a full-attention layer) and its layer type's mask over the rows from
    there on."""

    __slots__ = ("cache", "mask", "start")

    def __init__(self, segment: Segment, mask: torch.Tensor | None, start: int) -> None:
        self.cache, self.mask, self.start = segment.cache, mask, start


def _mlp(mlp: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``mlp.forward``: gate and up as two projections (Llama, Gemma) or one stacked (Phi-3)."""
    if hasattr(mlp, "gate_up_proj"):
        gate, up = mlp.gate_up_proj.forward(hidden).chunk(2, dim=-1)
        return mlp.down_proj.forward(up * mlp.activation_fn(gate))
    return mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(hidden)) * mlp.up_proj.forward(hidden))


def _stacked_qkv(attention: nn.Module) -> StackedProjection | None:
    """The layer's q|k|v projection when :mod:`diffdraft.kernels.fused_projections` stacked it and nothing
    stands between it and the rotation (Qwen3's and Gemma 3's per-head norms do), so q and k rotate as
    one. Phi-3's own projection is stacked already (:func:`_attention` splits it)."""
    if hasattr(attention, "q_norm") or not hasattr(attention, "q_proj"):
        return None
    return stacked_projection(attention.q_proj, attention.k_proj, attention.v_proj)


def _keywords(attention: nn.Module) -> dict:
    """The keywords the stock layer passes its attention function beyond the common ones: the window
    (Qwen2/3 and Gemma: the layer's; Mistral and Phi-3: the config's) and Gemma 2's soft-cap."""
    name = type(attention).__name__
    extra = {}
    if hasattr(attention, "sliding_window"):
        extra["sliding_window"] = attention.sliding_window
    elif name in ("MistralAttention", "Phi3Attention"):
        extra["sliding_window"] = getattr(attention.config, "sliding_window", None)
    if name == "Gemma2Attention":
        extra["softcap"] = attention.attn_logit_softcapping
    return extra


def _attention(
    attention: nn.Module,
    stacked: StackedProjection | None,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    views: list[_Visible],
    rows: list[slice],
    attend,
    keywords: dict,
) -> torch.Tensor:
    """``attention.forward`` of the supported families, minus its keyword plumbing, per segment;
    ``keywords``: the layer's :func:`_keywords`."""
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    if hasattr(attention, "qkv_proj"):  # Phi-3: one projection, split by columns; rope on a part
        qkv = attention.qkv_proj.forward(hidden)
        query_columns = attention.config.num_attention_heads * attention.head_dim
        key_columns = attention.num_key_value_heads * attention.head_dim
        query = qkv[..., :query_columns].view(shape).transpose(1, 2)
        key = qkv[..., query_columns : query_columns + key_columns].view(shape).transpose(1, 2)
        value = qkv[..., query_columns + key_columns :].view(shape).transpose(1, 2)
        query, key = apply_partial_rotary_pos_emb(query, key, *rotary)
    elif stacked is not None:  # rotate q and k heads in one go: the same elementwise ops per element
        heads = stacked.linear(hidden).view(shape).transpose(1, 2)  # [b, q + k + v heads, n, d]
        query_heads, key_heads = (c.stop - c.start for c in stacked.columns[:2])
        split = (query_heads + key_heads) // attention.head_dim
        rotated, value = heads[:, :split], heads[:, split:]
        cos, sin = (part.unsqueeze(1) for part in rotary)
        rotated = (rotated * cos) + (rotate_half(rotated) * sin)
        query, key = (
            rotated[:, : query_heads // attention.head_dim],
            rotated[:, query_heads // attention.head_dim :],
        )
    else:
        query = attention.q_proj.forward(hidden).view(shape)
        key = attention.k_proj.forward(hidden).view(shape)
        norms_after_split = type(attention).__name__ == "Gemma3Attention"
        if hasattr(attention, "q_norm") and not norms_after_split:  # Qwen3: each head, then transpose
            query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if norms_after_split:  # Gemma 3 normalizes the transposed heads
            query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
        value = attention.v_proj.forward(hidden).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *rotary)
    outputs = []
    for view, part in zip(views, rows, strict=True):
        keys, values = view.cache.update(key[:, :, part], value[:, :, part], attention.layer_idx)
        if view.start:  # a windowed layer: only the rows its queries can see
            keys, values = keys[:, :, view.start :], values[:, :, view.start :]
        out, _ = attend(
            attention,
            query[:, :, part],
            keys,
            values,
            view.mask,
            dropout=0.0,
            scaling=attention.scaling,
            position_ids=positions[:, part],
            **keywords,
        )
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return attention.o_proj.forward(out.reshape(*shape[:-2], -1).contiguous())
