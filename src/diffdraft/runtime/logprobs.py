"""The target's log-probabilities of the tokens a generation commits, for callers that ask for them.

They come from the forward that verified each token (the prefill for the first), so they cost no
extra target forward: one log-softmax over the committed rows. They are the target's raw
distribution (temperature 1, no top-k / top-p), as vLLM and OpenAI report them, and they are the
same numbers plain decoding gives up to float rounding (verification scores a tree in one batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on alternatives per token."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The most likely tokens at this position with their log-probabilities, most likely first
    (as many as asked for; the committed token may or may not be among them)."""

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


class LogprobRecorder:
    """Collects a :class:`TokenLogprob` for every committed token, in order, with ``top`` alternatives."""

    def __init__(self, top: int = 0) -> None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        self.top = top
        self.tokens: list[TokenLogprob] = []

    def record(self, logits: torch.Tensor, token_ids: list[int]) -> None:
        """``logits`` [len(token_ids), V]: row i is the distribution token i was committed from."""
        if not token_ids:
            return
        log_probs = logits[: len(token_ids)].float().log_softmax(-1)
        chosen = log_probs.gather(1, torch.tensor(token_ids, device=log_probs.device)[:, None])[:, 0].tolist()
        if self.top:
            values, ids = log_probs.topk(self.top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in token_ids]
        self.tokens.extend(
            TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)
        )
