"""The model families diffdraft claims to speculate on losslessly, in one place.

A family is claimed when tests/target/test_conformance.py shows every method greedy-identical to
plain decoding and to transformers' own ``generate`` on a tiny random model of it (the README's
"Model families" table). Speculation on any other family is refused before the first round
(:func:`check_claimed`); plain decoding (no drafter) runs any causal LM.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffdraft.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    """The text config's ``model_type``."""
    config_class: str
    """The transformers config class the conformance test builds it from."""


CLAIMED_FAMILIES = (
    Family("Llama", "llama", "LlamaConfig"),
    Family("Qwen2", "qwen2", "Qwen2Config"),
    Family("Qwen3", "qwen3", "Qwen3Config"),
    Family("Mistral", "mistral", "MistralConfig"),
    Family("Phi-3", "phi3", "Phi3Config"),
    Family("Gemma 2", "gemma2", "Gemma2Config"),
    Family("Gemma 3 (text)", "gemma3_text", "Gemma3TextConfig"),
)
CLAIMED_MODEL_TYPES = frozenset(family.model_type for family in CLAIMED_FAMILIES)


def check_claimed(config) -> None:
    """Refuse speculation on a target whose family is not claimed, naming it and the claimed ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in CLAIMED_MODEL_TYPES:
        return
    claimed = ", ".join(f"{family.name} ({family.model_type})" for family in CLAIMED_FAMILIES)
    raise UnsupportedModelError(
        f"speculative decoding is not verified on model type {model_type!r}; the claimed families are "
        f"{claimed}. Plain decoding (no drafter, method 'ar') runs it"
    )
