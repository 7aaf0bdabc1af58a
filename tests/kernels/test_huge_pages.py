"""What a forward streams on huge pages: the block kernels' weights moved there with the same bytes,
same tensors and same logits, and zeroed tensors made there."""

from __future__ import annotations

import mmap

import pytest
import torch

from diffdraft.kernels import huge_pages
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.huge_pages import HUGE_PAGE, block_weights_on_huge_pages, move_to_huge_pages

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target

needs_huge_page_advice = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="this platform has no madvise(MADV_HUGEPAGE)"
)


@needs_huge_page_advice
def test_tensors_keep_their_values_and_identity_in_one_aligned_mapping():
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 256, (3, 5000), dtype=torch.uint8, generator=generator),
        torch.randn(7, 33, generator=generator).to(torch.bfloat16),
        torch.randn(1000, generator=generator),
    ]
    before = [t.clone() for t in tensors]
    holders = [t.view(-1) for t in tensors]  # views made before the move keep the old storage
    moved = move_to_huge_pages(tensors)
    assert moved == sum(t.nbytes for t in tensors)
    for tensor, value in zip(tensors, before, strict=True):
        torch.testing.assert_close(tensor, value, rtol=0, atol=0)
    pointers = [t.data_ptr() for t in tensors]
    assert pointers[0] % HUGE_PAGE == 0  # the mapping's first tensor starts on a huge page
    assert all(p % 4096 == 0 for p in pointers) and pointers == sorted(pointers)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one mapping for all
    for holder, value in zip(holders, before, strict=True):  # which stays alive and intact for them
        torch.testing.assert_close(holder, value.view(-1), rtol=0, atol=0)


def test_nothing_moves_without_huge_page_advice(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    tensor = torch.arange(4096, dtype=torch.int32)
    pointer = tensor.data_ptr()
    assert move_to_huge_pages([tensor]) == 0
    assert tensor.data_ptr() == pointer


@needs_block_kernel
@needs_huge_page_advice
def test_a_block_target_moves_every_kernel_tile_and_gives_the_same_logits():
    model, _ = q4_1_target("llama", layers=2)
    fuse_projections(model)  # stacked q|k|v and gate|up hold their own tiles
    tokens = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(tokens).logits
    streamed = huge_pages._streamed_tensors([model])
    assert len(streamed) == 4 * model.config.num_hidden_layers  # q|k|v, o, gate|up, down a layer
    assert block_weights_on_huge_pages(model) == sum(t.nbytes for t in streamed)
    assert len({t.untyped_storage().data_ptr() for t in streamed}) == 1  # moved in place, together
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=0)


@needs_huge_page_advice
def test_a_zeroed_tensor_on_huge_pages_only_from_one_huge_page_up():
    tensor = huge_pages.huge_page_zeros((2, 3, 4096, 64), torch.bfloat16)  # 3 MB
    assert tensor is not None and tensor.shape == (2, 3, 4096, 64) and tensor.dtype == torch.bfloat16
    assert tensor.data_ptr() % HUGE_PAGE == 0 and tensor.is_contiguous()
    assert not tensor.any()
    tensor[1, 2, -1, -1] = 1.5  # writable, every byte of it
    assert tensor.sum().item() == 1.5
    assert huge_pages.huge_page_zeros((1, 1024), torch.float32) is None  # 4 KB: stays with torch
