"""The rotary embedding a drafter sized to a target takes from the target's config."""

from __future__ import annotations

from diffdraft.kernels.attention_window import FULL

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def drafter_rope(target_config) -> dict:
    """The target's rope parameters, or its full-attention layers' where each layer type has its own
    (Gemma 3's local and global bases): a drafter attends over the whole context as those layers do."""
    rope = getattr(target_config, "rope_parameters", None) or DEFAULT_ROPE
    return dict(rope.get(FULL, rope))
