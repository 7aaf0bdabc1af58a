"""Linear layers whose weights are laid out once for oneDNN: faster CPU inference, same numbers.

A stock ``nn.Linear`` in bfloat16 on CPU hands oneDNN a plain row-major weight on every call, and
oneDNN reorders it into its blocked layout each time. For a small model decoding one token at a
time that reorder is most of the matmul, so reordering every weight once up front makes a decode
step much faster (docs/decisions.md, "weights packed once for oneDNN"), with
bit-identical logits (the same oneDNN kernel runs on the same data; only the per-call reorder is
gone).

Only bfloat16 is packed: in float32 stock PyTorch uses MKL, whose results differ from oneDNN's in
the last bits, and losslessness against plain decoding must not hinge on that. Packing is for
inference: the packed weight takes no gradient and does not follow ``module.to()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packed weights run (and give stock results) for this dtype and device."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class InferenceLinear(nn.Module):
    """A linear layer whose weight is laid out for one kernel: inference only. Siblings of one kind
    (:meth:`can_stack`) can be stacked into one layer (:mod:`diffdraft.kernels.fused_projections`)."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def stack_key(self) -> tuple:
        """Layers with equal keys can be stacked by :meth:`stacked` (see :meth:`can_stack`)."""
        return type(self), self.in_features, self.bias is None

    @classmethod
    def can_stack(cls, siblings: list[InferenceLinear]) -> bool:
        """Whether :meth:`stacked` takes ``siblings``: by default, when their keys are equal."""
        return len({sibling.stack_key() for sibling in siblings}) == 1

    @classmethod
    def stacked(cls, siblings: list[InferenceLinear]) -> InferenceLinear:
        """One layer whose outputs are the siblings' side by side, each column bit-identical to its own."""
        raise NotImplementedError

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The plain weight, as ``nn.Linear`` saves it (rebuilt from the kernel's layout)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    @staticmethod
    def stacked_bias(siblings: list[InferenceLinear]) -> torch.Tensor | None:
        return None if siblings[0].bias is None else torch.cat([s.bias.detach() for s in siblings])


class PackedLinear(InferenceLinear):
    """``nn.Linear`` with its weight reordered once; :attr:`weight` and ``state_dict`` still give
    the plain weight (rebuilt on demand, so the model holds one copy of each weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """``weight`` [out, in] and ``bias`` [out] as in ``nn.Linear``."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rows_hint = 1  # oneDNN's layout hint for the input rows; every row count tried gains with it
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    @classmethod
    def stacked(cls, siblings: list[PackedLinear]) -> PackedLinear:
        """The same oneDNN kernel over the stacked weight: each column reduces its input as before."""
        return cls(torch.cat([sibling.weight for sibling in siblings]), cls.stacked_bias(siblings))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linear(linear: nn.Module) -> nn.Module:
    """``linear`` packed when it is a plain ``nn.Linear`` whose dtype and device support it, else itself."""
    if type(linear) is not nn.Linear or not packing_supported(linear.weight.dtype, linear.weight.device):
        return linear
    return PackedLinear(linear.weight, linear.bias)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """An inference layer over ``weight`` [out, in] and ``bias``: packed where :func:`packing_supported`
    (oneDNN packs bfloat16 only on CPUs with AVX-512 or AVX-NE-CONVERT), else a plain ``nn.Linear``."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")  # no weights yet
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return pack_linear(linear)


def pack_linear_layers(model: nn.Module, lay_out: Callable[[nn.Module], nn.Module] = pack_linear) -> int:
    """Replace every ``nn.Linear`` inside ``model`` that ``lay_out`` (by default :func:`pack_linear`)
    lays out for inference, in place; returns how many were replaced.

    A weight tied to another module (an LM head sharing the input embedding) stays alive there, so
    only untied weights are freed.
    """
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            replacement = lay_out(child)
            if replacement is not child:
                setattr(module, name, replacement)
                packed += 1
    return packed


def has_packed_layers(model: nn.Module) -> bool:
    """Whether ``model`` was laid out for inference (packed or block-quantized linear layers)."""
    return any(isinstance(module, InferenceLinear) for module in model.modules())
