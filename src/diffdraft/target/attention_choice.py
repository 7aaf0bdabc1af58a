"""Which of transformers' attention implementations a target loads with."""

from __future__ import annotations

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


def attention_implementation(config) -> str:
    """SDPA where the family's causal LM supports it (the fused CPU attention and the lean forward build
    on it); eager attention otherwise: Gemma 2 soft-caps its attention logits, which SDPA cannot."""
    return "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
