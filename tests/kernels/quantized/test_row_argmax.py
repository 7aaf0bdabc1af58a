"""The greedy pick on the CPU kernel gives torch's index on every row: ties, signed zeros, NaN, -inf,
partial registers, one row or many (threaded)."""

from __future__ import annotations

import pytest
import torch

from diffdraft.kernels.quantized.row_argmax import greedy_rows
from diffdraft.runtime.sampling import greedy_tokens

from diffdraft_testing.markers import needs_block_kernel

pytestmark = needs_block_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_kernel_picks_torchs_index_on_random_rows_with_ties_and_nan(dtype, width, rows):
    logits = (3 * torch.randn(rows, width, generator=torch.Generator().manual_seed(width + rows))).to(dtype)
    if width > 4:
        logits[0, [2, width - 1]] = logits[0].max()  # a tie for the maximum: the first index wins
        logits[-1, [3, width - 2]] = float("nan")  # NaN is the maximum: the first one wins
    assert torch.equal(greedy_rows(logits), greedy_tokens(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_zeros_tie_and_a_row_of_minus_infinity_picks_its_first_index(dtype):
    logits = torch.tensor([[-1.0, 0.0, -0.0], [-5.0, -0.0, 0.0], [float("-inf")] * 3]).to(dtype)
    assert greedy_rows(logits).tolist() == greedy_tokens(logits).tolist() == [1, 1, 0]


def test_leading_dimensions_are_kept_and_other_dtypes_fall_back_to_torch():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy_rows(logits), greedy_tokens(logits))
    assert greedy_rows(logits).shape == (2, 3)
    assert torch.equal(greedy_rows(logits.double()), greedy_tokens(logits.double()))
    strided = logits.transpose(1, 2)  # not contiguous: copied first
    assert torch.equal(greedy_rows(strided), greedy_tokens(strided))


def test_rows_off_the_cpu_never_ask_for_the_cpu_kernel(monkeypatch):
    """Asking compiles the CPU library (seconds to minutes of a lent GPU's time, for nothing)."""
    import diffdraft.kernels.quantized.row_argmax as row_argmax

    def no_kernel():
        raise AssertionError("the CPU kernel was asked for")

    monkeypatch.setattr(row_argmax, "_kernel", no_kernel)
    logits = torch.zeros(3, 7, device="meta")
    assert greedy_rows(logits).shape == (3,)
    assert greedy_rows(torch.zeros(3, 7, dtype=torch.float64)).tolist() == [0, 0, 0]
