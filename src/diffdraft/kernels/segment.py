"""One sequence's share of a packed verification forward, as the lean forward and the fused decoder
layers both read it."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import DynamicCache

from diffdraft.kernels.attention_window import Mask


@dataclass
class Segment:
    """One sequence of a packed forward: its cache, how many of the tokens are its, and its mask."""

    cache: DynamicCache
    length: int
    mask: Mask | None
    """Additive; a dict by layer type for a hybrid target (:mod:`diffdraft.kernels.attention_window`)."""
