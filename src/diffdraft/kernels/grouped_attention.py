"""CPU attention for grouped-query targets: no cache copies under a mask, query groups as rows.

Hugging Face's SDPA attention lets the kernel share each K/V head across its query group
(``enable_gqa``) only when no mask is passed. A tree verification always passes one, so every
layer first copies its whole cached keys and values once per query group (SmolLM2: 3 copies of
3 heads) before the kernel runs. PyTorch's CPU kernel handles grouped heads under a mask itself,
with bit-identical output, so on CPU diffdraft targets attend through this function instead.

In bfloat16 / float16 it goes one step further: the query heads that share a K/V head become rows of
one head (``[b, kv_heads, group * q, d]``), so the kernel packs each cached K/V head once instead of
once per query head. PyTorch's CPU flash kernel spends most of a bfloat16 decode step packing, so
rows make a one-token query much faster and larger trees somewhat faster (docs/decisions.md,
"grouped-query attention as rows of one head"). The rows are the same dot products and
softmax, but the kernel blocks them differently, so outputs can differ from stock transformers' by
rounding (an ulp of the output at times). Float32 keeps the stock computation, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import sdpa_mask

NAME = "diffdraft_grouped_sdpa"
ROW_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose CPU kernel is faster with query groups as rows (float32 is not: measured slower)."""


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function signature: [B, H, q, d] in, [B, q, H, d] out."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    implicit_causal = causal and attention_mask is None and query.shape[2] > 1
    if not implicit_causal and dropout == 0.0 and _groups_fit_as_rows(query, key, attention_mask):
        return _query_groups_as_rows(query, key, value, attention_mask, scaling), None
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=implicit_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _groups_fit_as_rows(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    heads, kv_heads = query.shape[1], key.shape[1]
    return (
        query.device.type == "cpu"
        and query.dtype in ROW_DTYPES
        and kv_heads < heads
        and heads % kv_heads == 0
        and (
            mask is None
            or (mask.dim() == 4 and mask.shape[1] in (1, heads) and mask.shape[2] == query.shape[2])
        )
    )


def _query_groups_as_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of query head ``h`` against K/V head ``h // group`` (as ``enable_gqa`` and
    ``repeat_kv`` pair them), computed with each group's heads stacked as rows of its K/V head."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * length, dim)
    if mask is not None:
        if mask.shape[1] == 1:  # one mask for every head: the same per group member
            mask = mask[:, :, None].expand(-1, -1, group, -1, -1)
        mask = mask.reshape(mask.shape[0], -1, group * length, mask.shape[-1])
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    out = out.view(batch, kv_heads, group, length, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, length, heads, dim)


AttentionInterface.register(NAME, grouped_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model that attends through SDPA to :func:`grouped_sdpa_attention`; returns
    whether it did (other devices and attention kernels are left alone)."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
