"""SDPA that reads grouped-query K/V heads in place under a mask too: same output, no cache copies.

Hugging Face's SDPA attention lets the kernel share each K/V head across its query group
(``enable_gqa``) only when no mask is passed. A tree verification always passes one, so every
layer first copies its whole cached keys and values once per query group (SmolLM2: 3 copies of
3 heads) before the kernel runs. PyTorch's CPU kernel handles grouped heads under a mask itself,
with bit-identical output, so on CPU diffdraft targets attend through this function instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.masking_utils import sdpa_mask

NAME = "diffdraft_grouped_sdpa"


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
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal and attention_mask is None and query.shape[2] > 1,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model that attends through SDPA to :func:`grouped_sdpa_attention`; returns
    whether it did (other devices and attention kernels are left alone)."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
