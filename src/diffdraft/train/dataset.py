"""Training sequences: prompt + the target's own regenerated response, as token ids."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from diffdraft.errors import InvalidRequestError


@dataclass
class TrainingSample:
    sample_id: str
    token_ids: torch.Tensor
    """[n] prompt then response, truncated to the maximum sequence length."""
    response_start: int
    """Index of the first response token; anchors are drawn from the response only."""


def load_responses(
    path: str | os.PathLike, max_length: int, min_response_tokens: int = 2
) -> list[TrainingSample]:
    """Read a regeneration jsonl (``id``, ``prompt_token_ids``, ``response_token_ids`` per line).

    Sequences longer than ``max_length`` keep their response and the *end* of their prompt: the
    prompt gets at least a quarter of the window, the response the rest (response tokens are what
    the drafter learns from; dropping long-prompt samples lost a large share of ShareGPT:
    docs/decisions.md, "long prompts cut from the front, not dropped"). Samples with fewer than
    ``min_response_tokens`` response tokens teach nothing and are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(
            f"training data {path} does not exist; run `diffdraft train regenerate` first"
        )
    samples = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip() or not line.endswith("\n"):
                continue  # blank, or the half-written last line of a regeneration still running
            try:
                record = json.loads(line)
                prompt, response = record["prompt_token_ids"], record["response_token_ids"]
                sample_id = str(record["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise InvalidRequestError(
                    f"{path}:{number} is not a regenerated sample (want a JSON object with id, "
                    f"prompt_token_ids and response_token_ids): {err}"
                ) from err
            sample = training_sample(sample_id, prompt, response, max_length, min_response_tokens)
            if sample is not None:
                samples.append(sample)
    if not samples:
        raise InvalidRequestError(
            f"{path} holds no usable training sample (empty, or every response too short)"
        )
    return samples


def training_sample(
    sample_id: str, prompt: list[int], response: list[int], max_length: int, min_response_tokens: int = 2
) -> TrainingSample | None:
    """One sequence cut to ``max_length`` as :func:`load_responses` cuts it, or None when too little of
    the response is left to learn from; one rule for every reader, so packed data trains the same."""
    prompt_room = max(min(len(prompt), max_length // 4), max_length - len(response))
    prompt = prompt[len(prompt) - prompt_room :] if prompt_room < len(prompt) else prompt
    ids = torch.tensor((prompt + response)[:max_length], dtype=torch.long)
    if ids.shape[0] - len(prompt) < min_response_tokens:
        return None
    return TrainingSample(sample_id, ids, len(prompt))
