"""Choosing the MASK token when the vocabulary has none."""

from __future__ import annotations

import pytest

from diffdraft.errors import InvalidRequestError
from diffdraft.train.mask_token import pick_mask_token

from conftest import tiny_tokenizer


def test_an_unused_control_token_is_chosen_over_special_ones():
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<ctl_a>", "<ctl_b>"], special_tokens=True)
    chosen = pick_mask_token(tokenizer, end_token_ids=[tokenizer.eos_token_id])
    assert tokenizer.convert_ids_to_tokens(chosen) == "<ctl_b>"


def test_a_real_mask_token_wins():
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert pick_mask_token(tokenizer, []) == tokenizer.mask_token_id


def test_no_candidate_asks_for_an_explicit_id():
    with pytest.raises(InvalidRequestError, match="--mask-token-id"):
        pick_mask_token(tiny_tokenizer(), [])


@pytest.mark.real_model
def test_smollm2_gets_a_control_token_it_never_emits_in_chat():
    from diffdraft.loading import load_target

    loaded = load_target("default")
    chosen = pick_mask_token(loaded.tokenizer, [2])
    assert loaded.tokenizer.convert_ids_to_tokens(chosen) == "<empty_output>"
