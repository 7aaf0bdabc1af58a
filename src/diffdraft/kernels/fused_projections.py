"""Sibling projections of one input computed as one matmul: fewer, larger CPU calls, same numbers.

Each decoder layer projects its normed input three times for attention (q, k, v) and twice for
the MLP (gate, up). Every packed call pays oneDNN's fixed cost and streams a small weight; one
call over the siblings' stacked weights computes each output column with the same kernel and the
same reduction over the input, so the columns are bit-identical to the separate calls (the tests
check widths, row counts and model families). A layer's seven matmuls become four, which shortens a
small model's CPU forward (docs/decisions.md, "sibling projections as one matmul").

The siblings stay in the model as :class:`ProjectionSlice` modules, so the model's own forward
code runs unchanged: the first sibling to see an input runs the stacked matmul, the others read
their columns of it. Inference only, like the packed weights it needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from diffdraft.kernels.packed_linear import InferenceLinear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of projections that read the same input (Llama, Qwen2/3, Mistral and kin)."""


class StackedProjection:
    """The siblings' stacked projection, run once per input and handed out column by column."""

    def __init__(self, siblings: Sequence[InferenceLinear]) -> None:
        self.linear = type(siblings[0]).stacked(list(siblings))
        edges = itertools.accumulate((sibling.out_features for sibling in siblings), initial=0)
        self.columns = [slice(a, b) for a, b in itertools.pairwise(edges)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._unread: set[int] = set()

    def output(self, sibling: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``sibling``'s projection of ``x``. The model's forward hands every sibling the
        same tensor object in a row, so identity tells a shared input; the stacked output is
        dropped once every sibling has read it, so no activations outlive the layer."""
        if x is not self._input or sibling not in self._unread:
            self._input, self._output = x, self.linear(x)
            self._unread = set(range(len(self.columns)))
        output = self._output[..., self.columns[sibling]]
        self._unread.discard(sibling)
        if not self._unread:
            self._input = self._output = None
        return output


class ProjectionSlice(nn.Module):
    """One sibling of a :class:`StackedProjection`; ``weight``/``bias``/``state_dict`` are its own rows."""

    def __init__(self, stacked: StackedProjection, sibling: int) -> None:
        super().__init__()
        self._stacked = stacked
        self._sibling = sibling
        columns = stacked.columns[sibling]
        self.in_features = stacked.linear.in_features
        self.out_features = columns.stop - columns.start

    @property
    def stacked(self) -> StackedProjection:
        return self._stacked

    @property
    def weight(self) -> torch.Tensor:
        return self._stacked.linear.weight[self._stacked.columns[self._sibling]]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self._stacked.linear.bias
        return None if bias is None else bias[self._stacked.columns[self._sibling]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._stacked.output(self._sibling, x)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stacked with its siblings"


def fuse_projections(model: nn.Module) -> int:
    """Stack every group of packed or block-quantized sibling projections inside ``model`` in place;
    returns how many groups were stacked (a group with a plain member, or whose members differ in
    kind, input width or in having a bias, is left alone)."""
    stacked = 0
    for module in list(model.modules()):
        for names in SIBLINGS:
            siblings = [getattr(module, name, None) for name in names]
            if not all(isinstance(s, InferenceLinear) for s in siblings):
                continue
            if not type(siblings[0]).can_stack(siblings):
                continue
            projection = StackedProjection(siblings)
            for index, name in enumerate(names):
                setattr(module, name, ProjectionSlice(projection, index))
            stacked += 1
    return stacked


def stacked_projection(*siblings: nn.Module) -> StackedProjection | None:
    """The stacked projection whose columns ``siblings`` are, all of them; None when they are not
    slices of one (a model that was not laid out, or only some siblings stacked)."""
    if not all(isinstance(sibling, ProjectionSlice) for sibling in siblings):
        return None
    stacked = siblings[0].stacked
    if any(sibling.stacked is not stacked for sibling in siblings) or len(stacked.columns) != len(siblings):
        return None
    return stacked
