"""One sequence's share of a packed verification forward, as the lean forward and the fused decoder
layers both read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Segment:
    """One sequence of a packed forward: its cache, how many of the tokens are its, and its mask."""

    cache: DynamicCache
    length: int
    mask: torch.Tensor | None
