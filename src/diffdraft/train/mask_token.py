"""Which target token the drafter uses as MASK.

DFlash uses a row of the target's (frozen) embedding table as the mask embedding. Vocabularies
with a spare mask token give it directly; otherwise we take an added control token the target
never emits in chat (e.g. SmolLM2's ``<empty_output>``), so the row carries no meaning that could
confuse the drafter. The choice is recorded in the drafter's config.
"""

from __future__ import annotations

from diffdraft.errors import InvalidRequestError


def pick_mask_token(tokenizer, end_token_ids: list[int]) -> int:
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    in_use = set(end_token_ids) | {
        getattr(tokenizer, name, None)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    in_use |= set(tokenizer.all_special_ids)
    spare = [i for i in tokenizer.added_tokens_decoder if i not in in_use]
    if not spare:
        raise InvalidRequestError(
            "the tokenizer has no mask token and no unused control token; "
            "pass --mask-token-id with the id of "
            "a token the target practically never emits"
        )
    return max(spare)
