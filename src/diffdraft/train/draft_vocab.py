"""Choosing a drafter's draft vocabulary: the target tokens its responses actually use.

A drafter that scores only these K tokens trains and drafts several times faster (the LM head and
softmax over a 49k vocabulary dominate a two-layer drafter; docs/decisions.md, "a draft vocabulary
for cheaper training"); a token outside the set can never be drafted, so K is picked to cover
nearly all of the target's output (see ``coverage``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.train.dataset import TrainingSample


def response_token_counts(samples: Sequence[TrainingSample], vocab_size: int) -> torch.Tensor:
    """[V] how often the target emitted each token in the training responses."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sample in samples:
        counts += torch.bincount(sample.token_ids[sample.response_start :], minlength=vocab_size)
    return counts


def frequent_tokens(samples: Sequence[TrainingSample], vocab_size: int, size: int) -> torch.Tensor:
    """Ids (ascending) of the ``size`` most frequent response tokens; ties go to the lower id.

    When the responses use fewer than ``size`` distinct tokens, the lowest unused ids fill the rest:
    BPE numbers its commonest merges first, so low ids are the best guess for tokens the data missed
    (on SmolLM2's HumanEval output the fill covered much of what a small set of responses missed;
    docs/decisions.md, "unseen draft-vocabulary slots go to the lowest ids").
    """
    if size < 1:
        raise InvalidRequestError(f"draft vocabulary size must be at least 1, got {size}")
    counts = response_token_counts(samples, vocab_size)
    # unseen ids rank after every seen one, in id order (the stable sort keeps ties in id order)
    order = torch.argsort(-counts, stable=True)[: min(size, vocab_size)]
    return order.sort().values


def coverage(samples: Sequence[TrainingSample], vocab: torch.Tensor, vocab_size: int) -> float:
    """Fraction of response tokens inside ``vocab``: the ceiling on what the drafter can propose."""
    counts = response_token_counts(samples, vocab_size)
    return float(counts[vocab].sum()) / max(1, int(counts.sum()))
