"""Training responses without regeneration: tokenize the source's own assistant replies.

The fixed-dataset route of EAGLE-1: no generation at all, so thousands of samples cost seconds
instead of hours, but the drafter learns the source model's answers rather than the target's. Use
it to add volume next to regenerated data when compute is short. Records have the same shape as
``regenerate``'s, with ids suffixed ``:reply`` so both kinds can share one training file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from diffdraft.data.prompts import Prompt
from diffdraft.target.loading import LoadedModel, end_token_ids, load_target
from diffdraft.train.regenerate import (
    RegenerateReport,
    SampleWriter,
    check_options,
    finished_ids,
    fit_history,
    only_writer,
)

REPLY_ID_SUFFIX = ":reply"


def write_source_replies(
    target_spec: str | os.PathLike,
    prompts: Iterable[Prompt],
    out_path: str | os.PathLike,
    max_new_tokens: int,
    max_prompt_tokens: int,
    progress: bool = True,
) -> RegenerateReport:
    """Append one record per prompt that has a reply and is not in ``out_path`` yet.

    A reply longer than ``max_new_tokens`` is cut there (``finish_reason`` ``max_new_tokens``);
    a complete one ends with the target's end-of-turn token, as the target's own replies do.
    """
    check_options(1.0, 1.0, max_new_tokens, max_prompt_tokens, 1)
    out_path = Path(out_path)
    with only_writer(out_path):
        report = RegenerateReport()
        done = finished_ids(out_path)
        report.already_done = len(done)
        todo = [p for p in prompts if p.reply is not None and p.id + REPLY_ID_SUFFIX not in done]
        if not todo:
            return report
        loaded = load_target(target_spec, "float32", "cpu")
        with SampleWriter(out_path, loaded.tokenizer, report, len(todo), progress) as writer:
            for reply in source_replies(loaded, todo, max_new_tokens, max_prompt_tokens, report):
                writer.write(*reply)
        return report


def source_replies(
    loaded: LoadedModel,
    prompts: Iterable[Prompt],
    max_new_tokens: int,
    max_prompt_tokens: int,
    report: RegenerateReport,
) -> Iterator[tuple[Prompt, list[int], list[int], str]]:
    """(prompt renamed ``<id>:reply``, prompt ids, response ids, finish reason) for each prompt with a
    reply whose history fits ``max_prompt_tokens`` (the others count as ``report.too_long``): the one
    tokenization that the jsonl route and ``train pack`` share."""
    tokenizer = loaded.tokenizer
    end_id = end_token_ids(loaded.model, tokenizer)[0]
    for prompt in prompts:
        if prompt.reply is None:
            continue
        prompt, prompt_ids = fit_history(tokenizer, prompt, max_prompt_tokens)
        if len(prompt_ids) > max_prompt_tokens:
            report.too_long += 1
            continue
        reply_ids = tokenizer.encode(prompt.reply, add_special_tokens=False)
        finished = len(reply_ids) < max_new_tokens
        response_ids = [*reply_ids, end_id] if finished else reply_ids[:max_new_tokens]
        renamed = Prompt(prompt.id + REPLY_ID_SUFFIX, prompt.messages)
        yield renamed, prompt_ids, response_ids, "eos" if finished else "max_new_tokens"
