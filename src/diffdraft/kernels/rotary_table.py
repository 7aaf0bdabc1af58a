"""A rotary embedding's cos/sin looked up per position instead of computed every forward.

Hugging Face's rotary module recomputes cos and sin for the forward's positions on every call, a
dozen small ops (docs/decisions.md, "rotary cos/sin from a table"): once per target
forward and twice per drafting round.
For the rope types whose frequencies never change each entry is one product of a position and a
frequency, then cos / sin, scaling and rounding, all elementwise, so rows computed once for a range of
positions and indexed are the module's own values bit for bit. Other types (dynamic, longrope:
frequencies that follow the sequence length) call the module, and so does every device but the CPU:
a lookup sizes the table from the positions on the host, which would wait on an accelerator (and cannot
happen inside the CUDA graph a verification is captured in).

A module with frequencies per layer type (Gemma 3's local and global bases: its ``forward`` takes
the layer type, its ``rope_type`` is a dict by type) gets one table per type, each built from the
module's own output for that type.
"""

from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rope types whose module keeps one set of frequencies for every position."""
FIRST_ROWS = 1024
"""Positions a table covers at first; it doubles past them."""


def per_layer_type(rotary: nn.Module) -> bool:
    """Whether ``rotary`` keeps frequencies per layer type (its ``forward`` takes the type)."""
    return isinstance(getattr(rotary, "rope_type", None), dict)


class RotaryTable:
    """``(cos, sin)`` of ``rotary`` for ``position_ids``, as ``rotary(like, position_ids)`` returns them
    (``rotary(like, position_ids, layer_type)`` for a module with frequencies per layer type)."""

    def __init__(self, rotary: nn.Module, layer_type: str | None = None) -> None:
        self.rotary = rotary
        self.layer_type = layer_type
        rope_type = getattr(rotary, "rope_type", None)
        if isinstance(rope_type, dict):
            if layer_type is None:
                raise ValueError("this rotary module keeps frequencies per layer type: name the layer type")
            rope_type = rope_type.get(layer_type)
        self.static = rope_type in STATIC_ROPE_TYPES
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per dtype, the CPU's table (other devices call the module)."""

    def __call__(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static or like.device.type != "cpu":
            return self._module(like, position_ids)
        cos, sin = self._table(like, int(position_ids.max()) + 1)
        return cos[position_ids], sin[position_ids]

    def rows(self, like: torch.Tensor, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` [end - begin, d] of positions ``begin`` .. ``end - 1``, the values
        :meth:`__call__` gives them; on the CPU slices of the table (no gather)."""
        if not self.static or like.device.type != "cpu":
            cos, sin = self._module(like, torch.arange(begin, end, device=like.device)[None])
            return cos[0], sin[0]
        cos, sin = self._table(like, end)
        return cos[begin:end], sin[begin:end]

    def _module(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.rotary(like, position_ids)
        return self.rotary(like, position_ids, self.layer_type)

    def _table(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(like.dtype)
        if table is None or table[0].shape[0] < rows:
            size = max(rows, FIRST_ROWS, 2 * table[0].shape[0] if table is not None else 0)
            positions = torch.arange(size, device=like.device)[None]
            cos, sin = self._module(like, positions)
            table = self._tables[like.dtype] = (cos[0], sin[0])
        return table
