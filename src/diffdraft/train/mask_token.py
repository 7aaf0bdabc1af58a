"""Training data for a drafter that reads its context must not contain its MASK id (picked by
:mod:`diffdraft.drafters.mask_token`): that text would read as MASK."""

from __future__ import annotations

from diffdraft.errors import InvalidRequestError
from diffdraft.train.dataset import TrainingSample


def refuse_mask_in_data(samples: list[TrainingSample], mask_token_id: int) -> None:
    """DEER reads the context's tokens: where the mask id is also text, that text would read as MASK."""
    hits = [s.sample_id for s in samples if bool((s.token_ids == mask_token_id).any())]
    if hits:
        raise InvalidRequestError(
            f"the mask token id {mask_token_id} occurs in {len(hits)} training samples (first: {hits[0]}), "
            "and a DEER drafter would read that text as MASK; choose an id the data never contains: "
            "--mask-token-id (or `diffdraft deer init --mask-token-id` for an --init-drafter), or leave "
            "it out to get an unused embedding row where the target has one"
        )
