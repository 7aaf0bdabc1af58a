"""The verification forward as one plain loop over the decoder layers: the same ops, less glue.

A Hugging Face forward wraps every layer and module call in hooks, keyword plumbing, output
recorders and mask preparation. On a small target on a CPU that glue is a visible share of a
verification forward (figures: benchmarks/README.md, 'Measurements behind the code'), and a
speculative round is mostly that forward. For the Llama-shaped families (Llama, Qwen2, Qwen3) this
loop calls the model's own module forwards and attention function in Hugging Face's order, so the
logits, taps and cache are bit-identical (the tests compare them); other families, and models with
sliding-window layers, keep Hugging Face's forward. Module hooks do not run on this path. Targets on
Q4_1 blocks, whose matmuls already differ from Hugging Face's in rounding, run their layers through
fused CPU ops instead (:mod:`diffdraft.kernels.quantized.decoder_ops`): deterministic and
batch-invariant rather than bit-identical.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    apply_rotary_pos_emb,
    eager_attention_forward,
    rotate_half,
)

from diffdraft.kernels.attention_window import FULL
from diffdraft.kernels.fused_projections import StackedProjection, stacked_projection
from diffdraft.kernels.quantized.block_linear import kernel_rows_only
from diffdraft.kernels.quantized.decoder_ops import FusedDecoderLayers
from diffdraft.kernels.rotary_table import RotaryTable
from diffdraft.kernels.segment import Segment

SUPPORTED_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
"""Decoder layers whose forward is the Llama one (Qwen3 adds per-head q/k norms, handled here)."""


class LeanForward:
    """Runs ``model`` (a supported causal LM) over a cache with a 4D mask; see the module docstring."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.rotary = RotaryTable(self.decoder.rotary_emb)
        self.layers = list(self.decoder.layers[: model.config.num_hidden_layers])
        self.stacked_qkv = [_stacked_qkv(layer.self_attn) for layer in self.layers]
        self.fused = FusedDecoderLayers.build(model, self.layers, self.stacked_qkv)
        """The layers as fused CPU ops, for Llama and Qwen2 targets on Q4_1 blocks; None otherwise."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if not layers or not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")):
            return False
        return all(
            type(layer).__name__ in SUPPORTED_LAYERS
            and getattr(layer.self_attn, "sliding_window", None) is None
            for layer in layers
        )

    def __call__(
        self,
        cache: DynamicCache,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        layer_ids: list[int],
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] for every input token (the last ``logits_to_keep`` only, where given) and taps
        [n, T, H] (None when ``layer_ids`` is empty).

        ``mask`` is the additive 4D mask of :meth:`TargetModel.attention_mask`; None only for a
        single token, which sees the whole cache."""
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
        hidden = self.decoder.embed_tokens.forward(token_ids[None])
        positions = position_ids[None]
        rotary = {FULL: self.rotary(hidden, positions)}
        rows = segment_rows(segments)
        last = len(self.layers) - 1
        tapped = sorted({i for i in layer_ids if i != last})
        if self.fused is not None:
            hidden, stacked = self.fused(hidden[0], rotary, segments, rows, tapped)
        else:
            hidden, stacked = self._layers(hidden, rotary, positions, segments, rows, tapped)
        stacked = _taps_in_order(stacked, tapped, layer_ids, hidden, last)
        logits = self.model.lm_head.forward(hidden[-logits_to_keep:][None])[0]  # [-0:]: every row
        if len(segments) == 1:
            return [(logits, stacked)]
        sizes = [segment.length for segment in segments]
        split_taps = stacked.split(sizes) if stacked is not None else [None] * len(segments)
        return list(zip(logits.split(sizes), split_taps, strict=True))

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
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.model.config._attn_implementation, eager_attention_forward
        )
        wanted, taps = set(tapped), []
        for index, (layer, stacked) in enumerate(zip(self.layers, self.stacked_qkv, strict=True)):
            residual = hidden
            normed = layer.input_layernorm.forward(hidden)
            hidden = residual + _attention(
                layer.self_attn, stacked, normed, rotary[FULL], positions, segments, rows, attend
            )
            residual = hidden
            mlp = layer.mlp
            normed = layer.post_attention_layernorm.forward(hidden)
            gated = mlp.act_fn(mlp.gate_proj.forward(normed)) * mlp.up_proj.forward(normed)
            hidden = residual + mlp.down_proj.forward(gated)
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


def _stacked_qkv(attention: nn.Module) -> StackedProjection | None:
    """The layer's q|k|v projection when :mod:`diffdraft.kernels.fused_projections` stacked it and nothing
    stands between it and the rotation (Qwen3's per-head norms do), so q and k rotate as one."""
    if hasattr(attention, "q_norm"):
        return None
    return stacked_projection(attention.q_proj, attention.k_proj, attention.v_proj)


def _attention(
    attention: nn.Module,
    stacked: StackedProjection | None,
    hidden: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    segments: list[Segment],
    rows: list[slice],
    attend,
) -> torch.Tensor:
    """``attention.forward`` of the Llama family, minus its keyword plumbing, per segment."""
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    if stacked is not None:  # rotate q and k heads in one go: the same elementwise ops per element
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
        if hasattr(attention, "q_norm"):  # Qwen3 normalizes each head before the rotation
            query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = attention.v_proj.forward(hidden).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *rotary)
    extra = {"sliding_window": None} if hasattr(attention, "sliding_window") else {}  # Qwen2/3 pass it
    outputs = []
    for segment, part in zip(segments, rows, strict=True):
        keys, values = segment.cache.update(key[:, :, part], value[:, :, part], attention.layer_idx)
        out, _ = attend(
            attention,
            query[:, :, part],
            keys,
            values,
            segment.mask,
            dropout=0.0,
            scaling=attention.scaling,
            position_ids=positions[:, part],
            **extra,
        )
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return attention.o_proj.forward(out.reshape(*shape[:-2], -1).contiguous())
