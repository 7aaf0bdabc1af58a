import pytest
import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.sampling import MIN_TEMPERATURE, SamplingParams, check_sampling, greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_the_argmax_of_every_row(dtype):
    logits = torch.randn(33, 4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_greedy_tokens_takes_the_first_index_on_ties():
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    logits[0, [3, 7]] = 1.0
    logits[1, [0, 9]] = 2.0
    assert greedy_tokens(logits).tolist() == [3, 0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature=1e-300), "temperature 1e-300 is too small to sample with: use 0 for greedy"),
        (dict(temperature=0.009), "temperature 0.009 is too small"),
        (dict(temperature=-1e-300), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be a number, got nan"),
        (dict(temperature=float("inf")), "temperature must be finite, got inf"),
        (dict(temperature=True), "temperature must be a number"),
        (dict(temperature=1.0, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.0000001), r"top_p must be in \(0, 1\]"),
    ],
)
def test_degenerate_sampling_parameters_are_refused_by_the_one_shared_check(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_sampling(**options)
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**options)


def test_the_smallest_temperature_allowed_still_gives_a_distribution_on_extreme_logits():
    logits = torch.tensor([[3e4, 3e4 - 0.5, -3e4, 0.0], [1.0, 1.0, 0.0, -1.0]])
    probs = SamplingParams(temperature=MIN_TEMPERATURE).probs(logits)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert 0 < probs[0, 1] < 1e-21 and probs[1, 0] == probs[1, 1]  # greedy in all but name; ties share
