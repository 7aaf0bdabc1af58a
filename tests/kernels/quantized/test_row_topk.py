"""The rows' top k on the CPU kernel: torch's values and indices where values are distinct, equal
values in index order, NaN above every number, -inf rows, partial registers, many rows (threaded),
and torch's own topk wherever the kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from diffdraft.kernels.quantized.row_topk import MAX_K, top_rows

from diffdraft_testing.markers import needs_block_kernel

pytestmark = needs_block_kernel


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 16384, 49152])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("k", [1, 6, 32, MAX_K])
def test_distinct_values_give_torchs_values_and_indices(width, rows, k):
    k = min(k, width)
    generator = torch.Generator().manual_seed(width * rows + k)
    scores = torch.randperm(rows * width, generator=generator).float().view(rows, width)  # no ties
    scores = scores.log_softmax(-1) if width > 1 else scores
    values, indices = top_rows(scores, k)
    expected = scores.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(indices, expected.indices)


def test_rising_rows_insert_every_value_and_still_come_out_sorted():
    """Every value of a rising row passes the threshold: the worst case for the inserting list."""
    scores = torch.arange(1000, dtype=torch.float32)[None].repeat(3, 1)
    values, indices = top_rows(scores, 10)
    assert indices.tolist() == [list(range(999, 989, -1))] * 3
    assert torch.equal(values, indices.float())


def test_equal_values_come_in_index_order_and_nan_ranks_above_every_number():
    # a copy's uniform row past the drafter's block: one token boosted, every other equal
    uniform = torch.full((1, 40), -10.0)
    uniform[0, 25] = -0.5
    values, indices = top_rows(uniform, 4)
    assert indices.tolist() == [[25, 0, 1, 2]]
    assert values.tolist() == [[-0.5, -10.0, -10.0, -10.0]]
    signed_zeros = torch.tensor([[-1.0, 0.0, -0.0, 0.0]])
    assert top_rows(signed_zeros, 3)[1].tolist() == [[1, 2, 3]]
    nan = torch.tensor([[1.0, float("nan"), 5.0, float("nan")] + [2.0] * 30])
    values, indices = top_rows(nan, 3)
    assert indices.tolist() == [[1, 3, 2]]
    assert values[0, :2].isnan().all() and values[0, 2] == 5.0


def test_rows_of_minus_infinity_and_leading_dimensions():
    scores = torch.full((2, 3, 50), float("-inf"))
    scores[1, 2, 7] = -3.0  # one finite value: the rest of its top are -inf, by index
    values, indices = top_rows(scores, 3)
    assert values.shape == indices.shape == (2, 3, 3)
    assert indices[0, 0].tolist() == [0, 1, 2]
    assert indices[1, 2].tolist() == [7, 0, 1]
    assert values[1, 2].tolist() == [-3.0, float("-inf"), float("-inf")]


def test_other_dtypes_larger_k_and_strided_rows_fall_back_to_or_match_torch():
    scores = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    for case, k in ((scores.double(), 5), (scores, MAX_K + 1), (scores.t().contiguous().t(), 5)):
        values, indices = top_rows(case, k)
        expected = case.topk(k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_rows_off_the_cpu_never_ask_for_the_cpu_kernel(monkeypatch):
    """Asking compiles the CPU library (seconds to minutes of a lent GPU's time, for nothing)."""
    import diffdraft.kernels.quantized.row_topk as row_topk

    def no_kernel():
        raise AssertionError("the CPU kernel was asked for")

    monkeypatch.setattr(row_topk, "_kernel", no_kernel)
    values, indices = top_rows(torch.zeros(3, 7, device="meta"), 2)
    assert values.shape == indices.shape == (3, 2)
    assert top_rows(torch.arange(7.0, dtype=torch.float64), 2)[1].tolist() == [6, 5]
