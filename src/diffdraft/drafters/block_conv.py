"""DFlash2's block convolution: a short causal convolution along a draft block, per channel, whose
kernel is a learnt base plus an offset each row computes from its own state for each channel group.

It lets a drafted row mix the rows just before it in its block (the anchor's and earlier masks') on
top of the block's bidirectional attention, at the cost of one small projection per row. Each DFlash2
layer has two: ``attention_conv`` around its attention and ``mlp_conv`` around its MLP. Both kernels
(the one that reads the sublayer's input and the one that reads its output) come from one projection
of the sublayer's input, so a conv is split into :meth:`BlockConv.prepare` and :meth:`BlockConv.finish`.
Rows never reach across blocks: a row at block offset ``i`` reads rows ``i - t`` for ``t <= i`` only.
Weight names and shapes are those vLLM reads (``base_kernel`` [2, taps, H],
``kernel_projection`` [2 * taps * groups, H])."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BlockConv(nn.Module):
    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if taps < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(
                f"conv_kernel_size {taps} and conv_group_size {group_size} must be positive, and the "
                f"group size must divide hidden_size {hidden_size}"
            )
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        # starts as the identity: tap 0 of both kernels is 1, the rest 0
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input [b, q, H] and the offsets [b, q, taps, groups] that
        :meth:`finish` applies to the sublayer's output, both from ``x`` [b, q, H] (block rows)."""
        offsets = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(x, offsets[..., 0, :, :], 0), offsets[..., 1, :, :]

    def finish(self, y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The sublayer output ``y`` [b, q, H] convolved with the second kernel."""
        return self._convolve(y, offsets, 1)

    def _convolve(self, x: torch.Tensor, offsets: torch.Tensor, side: int) -> torch.Tensor:
        """``out[i] = sum_t (base[side, t] + offsets[i, t]) * x[i - t]`` over the taps with ``t <= i``;
        an offset spans its channel group."""
        kernel = self.base_kernel[side].unflatten(-1, (self.groups, self.group_size)) + offsets[..., None]
        rows = x.unflatten(-1, (self.groups, self.group_size))  # [b, q, groups, group_size]
        out = kernel[..., 0, :, :] * rows
        for tap in range(1, min(self.taps, x.shape[-2])):
            earlier = F.pad(rows[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))  # row i sees row i - tap
            out = out + kernel[..., tap, :, :] * earlier
        return out.flatten(-2)
