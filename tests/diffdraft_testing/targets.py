"""Tiny random targets of every family diffdraft claims, built from transformers' own config classes, and
transformers' own greedy decoding of them as the reference."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

FAMILIES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "mistral": MistralConfig,
    "phi3": Phi3Config,
}


def tiny_target(
    family: str = "llama",
    seed: int = 0,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 4,
    max_positions: int = 256,
    dtype: torch.dtype = torch.float64,
    init_std: float = 0.2,
    **config_overrides,
) -> torch.nn.Module:
    """A random causal LM. float64 by default so greedy ties never depend on kernel rounding.

    The large init std makes next-token distributions peaked, like a real model's, so drafts get
    accepted and long accepted paths are exercised.
    """
    config = FAMILIES[family](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=config_overrides.pop("tie_word_embeddings", False),
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
        **config_overrides,
    )
    torch.manual_seed(seed)
    attention = "eager" if family == "gemma2" else "sdpa"  # Gemma 2's attention soft-capping has no SDPA
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(dtype).eval()


WINDOWED_FAMILIES = ("gemma2", "gemma3", "mistral", "phi3", "qwen2", "qwen3")
"""Families :func:`windowed_target` builds with sliding-window layers."""


def windowed_target(family: str, window: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """:func:`tiny_target` of ``family`` with windows of ``window`` keys: Gemma 2 alternating windowed
    and full layers, Gemma 3 one full layer in four (the third), windowed Qwen2 and Qwen3 their last
    two layers, Mistral and Phi-3 every layer."""
    layers = overrides.pop("layers", 4)
    hybrid = {
        "gemma2": dict(layer_types=["sliding_attention", "full_attention"] * (layers // 2)),
        "gemma3": dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        ),
        "qwen2": dict(use_sliding_window=True, max_window_layers=layers - 2),
        "qwen3": dict(use_sliding_window=True, max_window_layers=layers - 2),
    }
    config = {**hybrid.get(family, {}), "sliding_window": window, **overrides}
    return tiny_target(family, seed=seed, layers=layers, **config)


def ignore_windows(monkeypatch) -> None:
    """Make every target built from now on attend as if it had no sliding window (masks and the rows
    its forward reads alike): what a verifier that ignored the window would compute."""
    from diffdraft.kernels.attention_window import FULL, LayerWindows

    def windowless(cls, config):
        return cls(types=(FULL,) * config.num_hidden_layers, window=None, by_type=False)

    monkeypatch.setattr(LayerWindows, "of", classmethod(windowless))


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The reference: transformers' own greedy generate, generated tokens only."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
