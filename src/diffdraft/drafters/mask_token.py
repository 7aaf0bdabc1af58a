"""Which target token the drafter uses as MASK.

A drafter reads MASK through a row of the embedding table (the target's own, frozen, for DFlash),
so the row must never stand for text: DEER reads the context's tokens, and a mask id that is also
text makes that text unreadable. In order of preference:

1. the tokenizer's own mask token;
2. the first unused embedding row: vocabularies padded past the tokenizer (Qwen2.5: 151,936 rows for
   151,665 tokens) have rows no text encodes to; the official DFlash example's ``<|MASK|>``, added
   to the tokenizer, gets this id. All-zero rows are skipped: every mask position would enter the
   drafter as the same zero vector;
3. without one, an added control token the chat does not use (SmolLM2: ``<empty_output>``). Real
   text may still contain it (Qwen2's ``<|file_sep|>`` joins files of repository-level code), so a
   DEER training run refuses data that does (:func:`diffdraft.train.mask_token.refuse_mask_in_data`).

The choice is recorded in the drafter's config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffdraft.errors import InvalidRequestError


@dataclass(frozen=True)
class MaskToken:
    token_id: int
    reason: str
    """Which kind of token it is and why it was picked, for the user to read."""


def pick_mask_token(tokenizer, end_token_ids: list[int], embedding: torch.Tensor) -> MaskToken:
    """The MASK token for a target with this tokenizer and input ``embedding`` table ([rows, hidden])."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return MaskToken(
            int(tokenizer.mask_token_id), f"{tokenizer.mask_token!r}, the tokenizer's mask token"
        )
    tokens = max(tokenizer.get_vocab().values()) + 1  # len(tokenizer) when ids are dense
    rows = embedding.shape[0]
    nonzero_rows = embedding[tokens:].detach().ne(0).any(dim=1).nonzero()
    if nonzero_rows.numel():
        token_id = tokens + int(nonzero_rows[0])
        return MaskToken(
            token_id,
            f"an unused embedding row: the embedding has {rows} rows and the tokenizer {tokens} tokens, so "
            f"no text encodes to ids {tokens} and up",
        )
    in_use = set(end_token_ids) | {
        getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    in_use |= set(tokenizer.all_special_ids)
    spare = [i for i in tokenizer.added_tokens_decoder if i not in in_use]
    no_row = (
        f"the embedding's {rows - tokens} rows beyond the tokenizer's {tokens} tokens are all zeros"
        if rows > tokens
        else f"the embedding has no row beyond the tokenizer's {tokens} tokens"
    )
    if not spare:
        raise InvalidRequestError(
            f"the tokenizer has no mask token and no unused control token, and {no_row}; pass "
            "--mask-token-id with the id of a token the target practically never emits"
        )
    token_id = max(spare)
    return MaskToken(
        token_id,
        f"{tokenizer.convert_ids_to_tokens(token_id)!r}, an added control token outside the chat format, "
        f"since {no_row}; DEER training refuses data that contains it",
    )
