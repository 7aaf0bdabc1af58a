"""Training data packed for a lent GPU: every sample's token ids in one compact file, no tokenizer work left.

A device call carries at most 64 MiB, and a lease's minutes are too few to tokenize there; the
default drafter's data as a responses jsonl is hundreds of MB of JSON. Packed, the samples are cut to
the training length once (the same rule :func:`~diffdraft.train.dataset.load_responses` applies), and
their token ids lie end to end as uint16 (int32 for vocabularies past 65,536) beside their offsets and
response starts, in a safetensors file; the ids, the length and the tokenizer it was made with ride in
its metadata, so ``train fit --data`` reads it in seconds and refuses it beside another tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from diffdraft.data.prompts import Prompt, ReadReport, read_source
from diffdraft.errors import InvalidRequestError
from diffdraft.target.loading import LoadedModel
from diffdraft.train.dataset import TrainingSample, load_responses, training_sample
from diffdraft.train.regenerate import RegenerateReport
from diffdraft.train.source_replies import source_replies
from diffdraft.util.progress import progress_bar

FORMAT = "diffdraft-packed-samples/1"
SUFFIX = ".safetensors"
UINT16_VOCAB = 1 << 16


@dataclass
class PackedInfo:
    """What a packed file records about how it was made."""

    max_length: int
    tokenizer_fingerprint: str
    samples: int
    tokens: int
    made_from: dict


def is_packed(path: str | os.PathLike) -> bool:
    """Packed files are safetensors; anything else given as training data is a responses jsonl."""
    return Path(path).suffix.lower() == SUFFIX


def reply_samples(
    loaded: LoadedModel,
    prompts: list[Prompt],
    max_new_tokens: int,
    max_prompt_tokens: int,
    max_length: int,
    report: RegenerateReport,
) -> list[TrainingSample]:
    """The sources' own replies to ``prompts``, tokenized as ``train regenerate --source-replies``
    tokenizes them and cut to ``max_length`` as training cuts them."""
    samples = []
    bar = progress_bar(total=len(prompts), desc="tokenizing replies", unit="prompt", dynamic_ncols=True)
    with bar:
        for prompt, prompt_ids, response_ids, _ in source_replies(
            loaded, _counted(prompts, bar), max_new_tokens, max_prompt_tokens, report
        ):
            report.written += 1
            report.generated_tokens += len(response_ids)
            sample = training_sample(prompt.id, prompt_ids, response_ids, max_length)
            if sample is not None:
                samples.append(sample)
    return samples


def response_samples(paths: list[str], max_length: int) -> list[TrainingSample]:
    """Samples of regeneration jsonl files (the target's own answers, say), cut as training cuts them."""
    return [sample for path in paths for sample in load_responses(path, max_length)]


def _counted(prompts: list[Prompt], bar) -> Iterable[Prompt]:
    for prompt in prompts:
        yield prompt
        bar.update(1)


def check_out_path(path: str | os.PathLike) -> None:
    """Checked before the tokenizing, not after it."""
    if not is_packed(path):
        raise InvalidRequestError(f"--out {path}: a packed file must end in {SUFFIX}")


def write_packed(
    samples: list[TrainingSample],
    path: str | os.PathLike,
    max_length: int,
    tokenizer_fingerprint: str,
    made_from: dict,
) -> PackedInfo:
    """Write ``samples`` (already cut to ``max_length``) to ``path``, atomically: a killed pack leaves
    no half file that a later fit would read."""
    path = Path(path)
    check_out_path(path)
    if not samples:
        raise InvalidRequestError("nothing to pack: every sample was dropped or too short")
    ids = [sample.sample_id for sample in samples]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError(
            "two samples share an id; ids decide the held-out split, so give each input file its own ids"
        )
    lengths = np.array([sample.token_ids.shape[0] for sample in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = torch.cat([sample.token_ids for sample in samples]).numpy()
    tokens = tokens.astype(np.uint16 if tokens.max() < UINT16_VOCAB else np.int32)
    info = PackedInfo(max_length, tokenizer_fingerprint, len(samples), int(offsets[-1]), made_from)
    metadata = {
        "format": FORMAT,
        "max_length": str(max_length),
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "made_from": json.dumps(made_from),
        "ids": json.dumps(ids),
    }
    tensors = {
        "tokens": tokens,
        "offsets": offsets,
        "response_starts": np.array([sample.response_start for sample in samples], dtype=np.int32),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)
    return info


def read_packed(path: str | os.PathLike) -> tuple[list[TrainingSample], PackedInfo]:
    """The samples of a file from :func:`write_packed`, as ``load_responses`` gives them."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"packed training data {path} does not exist; run `diffdraft train pack`")
    try:
        with safe_open(path, framework="numpy") as packed:
            metadata = packed.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise InvalidRequestError(
                    f"{path} is a safetensors file but not packed training data ({FORMAT}); "
                    "make one with `diffdraft train pack`"
                )
            tokens = packed.get_tensor("tokens").astype(np.int64)
            offsets = packed.get_tensor("offsets")
            starts = packed.get_tensor("response_starts").tolist()
    except SafetensorError as error:
        raise InvalidRequestError(f"{path} is not readable safetensors ({error}); pack again") from error
    ids = json.loads(metadata["ids"])
    if not len(ids) == len(starts) == len(offsets) - 1 or offsets[-1] != tokens.shape[0]:
        raise InvalidRequestError(f"{path} is damaged (its ids, offsets and tokens disagree); pack again")
    token_ids = torch.from_numpy(tokens)
    bounds = zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    samples = [
        TrainingSample(sample_id, token_ids[begin:end], start)
        for sample_id, (begin, end), start in zip(ids, bounds, starts, strict=True)
    ]
    info = PackedInfo(
        int(metadata["max_length"]),
        metadata["tokenizer_fingerprint"],
        len(samples),
        int(offsets[-1]),
        json.loads(metadata["made_from"]),
    )
    return samples, info


def check_packed_for(info: PackedInfo, path: str | os.PathLike, max_length: int, fingerprint: str) -> None:
    """Refuse a packed file cut to another length, or tokenized for another tokenizer (its ids would
    mean other text)."""
    if max_length != info.max_length:
        raise InvalidRequestError(
            f"{path} was packed with --max-length {info.max_length}; train with that length (leave "
            f"--max-length out), or pack again with --max-length {max_length}"
        )
    if fingerprint != info.tokenizer_fingerprint:
        raise InvalidRequestError(
            f"{path} was packed with another tokenizer ({info.tokenizer_fingerprint}, the target's is "
            f"{fingerprint}); pack again with --target naming this target"
        )


def conversation_openings(path: str | os.PathLike) -> set[str]:
    """The first message of every conversation in an eval file (any shape ``train prompts`` reads)."""
    report = ReadReport(str(path))
    return {_opening(prompt) for prompt in read_source(str(path), report)}


def drop_same_openings(prompts: Iterable[Prompt], openings: set[str]) -> tuple[list[Prompt], int]:
    """Drop every prompt whose conversation opens with one of ``openings``: the 13-gram check misses
    a short boilerplate opening a held-out prompt shares (13 such conversations in ShareGPT)."""
    kept, dropped = [], 0
    for prompt in prompts:
        if _opening(prompt) in openings:
            dropped += 1
        else:
            kept.append(prompt)
    return kept, dropped


def _opening(prompt: Prompt) -> str:
    return json.dumps(prompt.messages[0], sort_keys=True, ensure_ascii=False)
