import pytest
import torch

from diffdraft.runtime.sampling import greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_the_argmax_of_every_row(dtype):
    logits = torch.randn(33, 4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_greedy_tokens_takes_the_first_index_on_ties():
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    logits[0, [3, 7]] = 1.0
    logits[1, [0, 9]] = 2.0
    assert greedy_tokens(logits).tolist() == [3, 0]
