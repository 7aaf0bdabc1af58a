"""Regenerate training responses with the target itself, so the drafter learns the target's own outputs.

Generation is batched HF ``generate`` with left padding. Each sample is appended to the output jsonl
and flushed the moment its row ends, and a restart skips the ids already written, so killing a run
that takes hours loses no finished sample.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from diffdraft.data.prompts import Prompt
from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.chat import encode_chat, encode_prompt
from diffdraft.target.loading import end_token_ids, load_target
from diffdraft.util.progress import progress_bar

# Batch 16 in bfloat16 regenerated fastest on our 2-core CPUs: bigger batches pad more and wait
# longer for their longest response, and float32 was slower. HF generate also beat diffdraft's own
# batch engine here (continuous batching, no padding, but attention per sequence), so regeneration
# stays on generate (docs/decisions.md, "regenerate at batch 16, and use source replies on a CPU").
DEFAULT_BATCH_SIZE = 16
DEFAULT_DTYPE = "bfloat16"
# Responses of a few hundred tokens (many end on their own before 384) give many 16-token draft
# blocks per sample. Prompts up to 512 tokens keep most of ShareGPT and prompt + response within the
# trainer's 1024-token sequences; longer prompts cost prefill and add no response tokens
# (docs/decisions.md, "regeneration caps: 384 new tokens, prompts up to 512").
DEFAULT_MAX_NEW_TOKENS = 384
DEFAULT_MAX_PROMPT_TOKENS = 512
# Prompts are sorted by length inside windows of this many batches: less padding, yet the order of
# the source still decides roughly what is done first.
SORT_WINDOW_BATCHES = 16


@dataclass
class RegenerateReport:
    """Counts for the user: what was there already, what was written now, what was skipped."""

    already_done: int = 0
    written: int = 0
    too_long: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        rate = self.generated_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.written} samples written ({self.generated_tokens} tokens, {rate:.1f} tok/s), "
            f"{self.already_done} already done, {self.too_long} prompts skipped as too long"
        )


def regenerate(
    target_spec: str | os.PathLike,
    prompts: Iterable[Prompt],
    out_path: str | os.PathLike,
    temperature: float = 0.6,
    top_p: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    dtype: str = DEFAULT_DTYPE,
    device: str | None = None,
    progress: bool = True,
) -> RegenerateReport:
    """Generate one response per prompt not yet in ``out_path`` and append it there as a jsonl record.

    A record holds ``id``, ``messages``, ``prompt_token_ids``, ``response_token_ids`` (with the end
    token when the target emitted one), ``response`` (text) and ``finish_reason`` (``eos`` or
    ``max_new_tokens``). ``temperature=0`` is greedy. ``seed`` seeds the run; a resumed run draws
    fresh samples for the prompts still to do.
    """
    check_options(temperature, top_p, max_new_tokens, max_prompt_tokens, batch_size)
    out_path = Path(out_path)
    with only_writer(out_path):
        report = RegenerateReport()
        done = finished_ids(out_path)
        todo = [prompt for prompt in prompts if prompt.id not in done]
        report.already_done = len(done)
        if not todo:
            return report
        loaded = load_target(target_spec, dtype, device)
        model, tokenizer = loaded.model, loaded.tokenizer
        encoded = []
        for prompt in todo:
            prompt, ids = fit_history(tokenizer, prompt, max_prompt_tokens)
            if len(ids) > max_prompt_tokens:
                report.too_long += 1
            else:
                encoded.append((prompt, ids))
        end_ids = end_token_ids(model, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
        sampling = temperature > 0
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_p=top_p if sampling else None,
            top_k=0 if sampling else None,
            eos_token_id=end_ids,
            pad_token_id=pad_id,
        )
        torch.manual_seed(seed)
        with SampleWriter(out_path, tokenizer, report, len(encoded), progress) as writer:
            for batch in length_sorted_batches(encoded, batch_size):
                _generate_batch(model, batch, config, end_ids, pad_id, writer)
        return report


class SampleWriter:
    """Appends and flushes one finished sample at a time, and keeps the progress bar and counts."""

    def __init__(
        self,
        path: Path,
        tokenizer: PreTrainedTokenizerBase,
        report: RegenerateReport,
        total: int,
        progress: bool,
    ):
        self.path, self.tokenizer, self.report = path, tokenizer, report
        self.bar = progress_bar(total=total, unit="sample", disable=not progress, dynamic_ncols=True)
        self.out = path.open("a", encoding="utf-8")
        self.start = time.perf_counter()

    def write(self, prompt: Prompt, prompt_ids: list[int], response_ids: list[int], reason: str) -> None:
        record = {
            "id": prompt.id,
            "messages": prompt.messages,
            "prompt_token_ids": prompt_ids,
            "response_token_ids": response_ids,
            "response": self.tokenizer.decode(response_ids, skip_special_tokens=True),
            "finish_reason": reason,
        }
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        self.report.written += 1
        self.report.generated_tokens += len(response_ids)
        self.report.seconds = time.perf_counter() - self.start
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.report.generated_tokens / self.report.seconds:.1f} tok/s")

    def __enter__(self) -> SampleWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.out.close()
        self.bar.close()


@contextmanager
def only_writer(path: Path) -> Iterator[None]:
    """Two runs appending to one file would write samples twice, so a second run stops instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            raise InvalidRequestError(
                f"another run is writing {path} right now; let it finish or stop it before resuming"
            ) from error
        yield


def finished_ids(path: str | os.PathLike) -> set[str]:
    """Ids already in a regeneration file. A last line a kill cut short is removed, to be done again.

    A line counts only once its newline is written, so a cut line is recognised even when the cut
    happens to leave valid JSON.
    """
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    good_end = 0
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.endswith(b"\n"):
                break
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as error:
                raise InvalidRequestError(
                    f"{path}: line {number} is not a regenerated sample (a JSON object with an 'id'), so "
                    "this file was not written by regenerate or was edited; fix that line or choose "
                    "another output file"
                ) from error
            good_end += len(line)
    if good_end < path.stat().st_size:
        os.truncate(path, good_end)
    return ids


def length_sorted_batches(
    items: Sequence[tuple[Prompt, list[int]]], batch_size: int
) -> list[list[tuple[Prompt, list[int]]]]:
    """Batches of similar prompt length (less left padding), sorted within windows of the input order."""
    window = batch_size * SORT_WINDOW_BATCHES
    batches = []
    for start in range(0, len(items), window):
        chunk = sorted(items[start : start + window], key=lambda item: len(item[1]), reverse=True)
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    return batches


def check_options(
    temperature: float, top_p: float, max_new_tokens: int, max_prompt_tokens: int, batch_size: int
) -> None:
    if temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}")
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("max_prompt_tokens", max_prompt_tokens),
        ("batch_size", batch_size),
    ):
        if value < 1:
            raise InvalidRequestError(f"{name} must be at least 1, got {value}")


def encode_for_target(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Chat-template the prompt; a tokenizer without a template (a base model) takes single-turn text."""
    if tokenizer.chat_template or len(prompt.messages) != 1:
        try:
            return encode_chat(tokenizer, prompt.messages)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"prompt {prompt.id!r}: {error}") from error
    return encode_prompt(tokenizer, prompt.messages[0]["content"])


def fit_history(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, max_prompt_tokens: int
) -> tuple[Prompt, list[int]]:
    """The prompt and its tokens, with the oldest exchanges of a later turn's history dropped (a
    system message stays) while it is over ``max_prompt_tokens``; still over, the caller skips it."""
    ids = encode_for_target(tokenizer, prompt)
    messages = prompt.messages
    while len(ids) > max_prompt_tokens:
        first = 1 if messages[0]["role"] == "system" else 0
        users = [i for i, message in enumerate(messages) if message["role"] == "user" and i > first]
        if not users:
            break
        messages = messages[:first] + messages[users[0] :]
        prompt = replace(prompt, messages=messages)
        ids = encode_for_target(tokenizer, prompt)
    return prompt, ids


class _RowEndWatcher(StoppingCriteria):
    """Hands each row to ``on_end`` at the step it ends; generate's own criteria do the stopping."""

    def __init__(
        self,
        prompt_width: int,
        end_ids: list[int],
        max_new_tokens: int,
        on_end: Callable[[int, list[int], str], None],
    ):
        self.prompt_width = prompt_width
        self.end_ids = end_ids
        self.max_new_tokens = max_new_tokens
        self.on_end = on_end
        self.ended: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        new_tokens = input_ids[:, self.prompt_width :]
        if self.ended is None:
            self.ended = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        ending = torch.isin(new_tokens[:, -1], torch.tensor(self.end_ids, device=input_ids.device))
        if new_tokens.shape[1] >= self.max_new_tokens:
            ending[:] = True
        for row in (ending & ~self.ended).nonzero().flatten().tolist():
            tokens = new_tokens[row].tolist()
            self.on_end(row, tokens, "eos" if tokens[-1] in self.end_ids else "max_new_tokens")
        self.ended |= ending
        return torch.zeros_like(ending)


@torch.inference_mode()
def _generate_batch(
    model: torch.nn.Module,
    batch: list[tuple[Prompt, list[int]]],
    config: GenerationConfig,
    end_ids: list[int],
    pad_id: int,
    writer: SampleWriter,
) -> None:
    width = max(len(ids) for _, ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, ids) in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1

    def on_end(row: int, response_ids: list[int], reason: str) -> None:
        prompt, prompt_ids = batch[row]
        writer.write(prompt, prompt_ids, response_ids, reason)

    watcher = _RowEndWatcher(width, end_ids, config.max_new_tokens, on_end)
    model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        generation_config=config,
        stopping_criteria=StoppingCriteriaList([watcher]),
    )
