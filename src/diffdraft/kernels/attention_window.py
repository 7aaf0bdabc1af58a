"""Which decoder layers attend through a sliding window, and the masks that tell them apart.

Gemma 2/3, windowed Qwen2, Cohere 2 and GPT-OSS interleave full-attention layers with layers whose
query at position ``p`` sees only the keys at ``p - window + 1 .. p``; every layer of Mistral and
Phi-3 is windowed. Hugging Face drops a windowed layer's old rows from its cache, so a rejected draft
could not be cropped back; diffdraft's caches keep every layer's rows (:mod:`~diffdraft.kernels.kv_cache`)
and the window lives in the mask instead. A verification forward gets one additive mask per layer type
(the form Hugging Face's own forward takes for a hybrid model), and a windowed layer reads only the
rows from :func:`window_start` on: the rows its queries can see, which are also the rows Hugging
Face's sliding cache would hold, so the attention sums the same terms in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"

Mask = torch.Tensor | dict[str, torch.Tensor]
"""A verification forward's additive 4D mask: one tensor for a target whose layers all attend alike
(Llama, Mistral: the window already applied), or one per layer type (:data:`FULL`, :data:`SLIDING`)
for a hybrid target, as Hugging Face's forward takes ``attention_mask``."""


@dataclass(frozen=True)
class LayerWindows:
    """Each decoder layer's attention type, and the window of the :data:`SLIDING` ones."""

    types: tuple[str, ...]
    window: int | None
    """Keys a windowed layer's query sees, itself included; None when no layer is windowed."""
    by_type: bool
    """Whether the model takes its mask as a dict by layer type (a config with ``layer_types``)."""

    @classmethod
    def of(cls, config) -> LayerWindows:
        """Read from a text config as Hugging Face's models do: ``layer_types`` where the config has
        them (Gemma 2/3, Qwen2/3, Cohere 2, GPT-OSS), else every layer windowed when
        ``sliding_window`` is set (Mistral, Phi-3)."""
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            types = tuple(layer_types[:layers])
        else:
            types = (SLIDING if window is not None else FULL,) * layers
        if window is None:
            types = (FULL,) * layers
        return cls(types=types, window=window if SLIDING in types else None, by_type=layer_types is not None)

    @property
    def windowed_layers(self) -> list[int]:
        return [index for index, kind in enumerate(self.types) if kind == SLIDING]

    def mask(self, full: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> Mask:
        """The forward's mask from the full-attention one [1, 1, n, keys]: the window added where a
        query at ``query_positions`` [n] would see a key at ``key_positions`` [keys] a window or more
        behind it."""
        if self.window is None:
            return full
        behind = query_positions[:, None] - key_positions[None, :] >= self.window
        windowed = full.masked_fill(behind, torch.finfo(full.dtype).min)
        if not self.by_type:
            return windowed
        return {kind: windowed if kind == SLIDING else full for kind in set(self.types)}


def layer_mask(mask: Mask | None, layer_type: str) -> torch.Tensor | None:
    """The mask one layer of ``layer_type`` attends under (None stays None: a lone token)."""
    return mask[layer_type] if isinstance(mask, dict) else mask


def window_start(past: int, window: int | None) -> int:
    """The first cache row a forward's queries can see in a windowed layer, when ``past`` rows were
    cached before it: the root sits at position ``past`` and no node sits before it (0 for a full
    layer, ``window`` None)."""
    return 0 if window is None else max(0, past - window + 1)
