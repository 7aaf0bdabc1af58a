"""Choosing the MASK token when the vocabulary has none."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.mask_token import pick_mask_token
from diffdraft.errors import InvalidRequestError

from diffdraft_testing.checkpoints import tiny_tokenizer

QWEN2_ADDED = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
"""Qwen2.5's last added tokens: not special, and real in repository-level code data."""


def qwen2_like_tokenizer():
    """Qwen2.5's layout in small: ChatML specials, then plain added tokens ending with ``<|file_sep|>``."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(QWEN2_ADDED)
    return tokenizer


def embedding(rows: int) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(0))


def test_a_vocabulary_padded_past_the_tokenizer_gets_its_first_unused_row_not_file_sep():
    tokenizer = qwen2_like_tokenizer()  # as Qwen2.5's 151,665 tokens in 151,936 rows
    n = len(tokenizer)
    chosen = pick_mask_token(tokenizer, [tokenizer.eos_token_id], embedding(n + 20))
    assert chosen.token_id == n
    assert chosen.reason == (
        f"an unused embedding row: the embedding has {n + 20} rows and the tokenizer {n} tokens, so no "
        f"text encodes to ids {n} and up"
    )


def test_all_zero_rows_are_passed_over():
    tokenizer = qwen2_like_tokenizer()
    n = len(tokenizer)
    table = embedding(n + 20)
    table[n : n + 2] = 0
    assert pick_mask_token(tokenizer, [], table).token_id == n + 2


@pytest.mark.parametrize(
    ("extra_rows", "why"),
    [
        (0, "since the embedding has no row beyond the tokenizer's {n} tokens"),
        (2, "since the embedding's 2 rows beyond the tokenizer's {n} tokens are all zeros"),
    ],
)
def test_without_an_unused_row_an_unused_control_token_is_chosen_and_the_reason_says_why(extra_rows, why):
    tokenizer = qwen2_like_tokenizer()
    n = len(tokenizer)
    table = embedding(n + extra_rows)
    table[n:] = 0
    chosen = pick_mask_token(tokenizer, [tokenizer.eos_token_id], table)
    assert tokenizer.convert_ids_to_tokens(chosen.token_id) == "<|file_sep|>"
    assert chosen.reason.startswith("'<|file_sep|>', an added control token outside the chat format")
    assert why.format(n=n) in chosen.reason and "DEER training refuses data that contains it" in chosen.reason


def test_an_unused_control_token_is_chosen_over_special_ones():
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<ctl_a>", "<ctl_b>"], special_tokens=True)
    chosen = pick_mask_token(tokenizer, [tokenizer.eos_token_id], embedding(len(tokenizer)))
    assert tokenizer.convert_ids_to_tokens(chosen.token_id) == "<ctl_b>"


def test_a_real_mask_token_wins():
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    chosen = pick_mask_token(tokenizer, [], embedding(320))
    assert chosen.token_id == tokenizer.mask_token_id
    assert chosen.reason == "'<mask>', the tokenizer's mask token"


def test_no_candidate_asks_for_an_explicit_id():
    tokenizer = tiny_tokenizer()
    n = len(tokenizer)
    with pytest.raises(
        InvalidRequestError, match=f"no row beyond the tokenizer's {n} tokens; pass --mask-token-id"
    ):
        pick_mask_token(tokenizer, [], embedding(n))


@pytest.mark.real_model
def test_smollm2_gets_a_control_token_it_never_emits_in_chat():
    from diffdraft.target.loading import load_target

    loaded = load_target("default")
    chosen = pick_mask_token(loaded.tokenizer, [2], loaded.model.get_input_embeddings().weight)
    assert loaded.tokenizer.convert_ids_to_tokens(chosen.token_id) == "<empty_output>"
    assert chosen.token_id == 16  # the shipped drafters' mask_token_id
