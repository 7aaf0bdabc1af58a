"""Prompt readers (every format, malformed records and files), ids, duplicates and decontamination."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from diffdraft.data.prompts import (
    SHAREGPT,
    Prompt,
    ReadReport,
    decontaminate,
    drop_duplicates,
    eval_texts,
    read_source,
    read_sources,
    word_ngrams,
    write_prompts,
)
from diffdraft.errors import InvalidRequestError


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_all(source):
    report = ReadReport(str(source))
    return list(read_source(str(source), report)), report


def test_messages_records_end_at_the_first_user_turn_and_keep_the_reply_beside(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "More"},
                ],
            }
        ],
    )
    prompts, report = read_all(path)
    assert prompts == [
        Prompt("a", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "Hello")
    ]
    assert (report.prompts, report.malformed) == (1, 0)
    written = tmp_path / "written.jsonl"
    write_prompts(prompts, written)
    assert read_all(written)[0] == prompts  # the reply survives a write and a read


def test_sharegpt_conversations_and_plain_prompts(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": 7, "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
            # A split conversation starting mid-answer keeps the answer as context for its user turn.
            {"conversations": [{"from": "gpt", "value": "...end"}, {"from": "human", "value": "continue"}]},
            {"prompt": "Write a haiku."},
        ],
    )
    prompts, _ = read_all(path)
    assert [p.id for p in prompts] == ["7", "mixed:2", "mixed:3"]
    assert prompts[0].messages == [{"role": "user", "content": "Q1"}]
    assert prompts[1].messages == [
        {"role": "assistant", "content": "...end"},
        {"role": "user", "content": "continue"},
    ]
    assert prompts[2].messages == [{"role": "user", "content": "Write a haiku."}]


def test_malformed_records_are_skipped_and_counted(tmp_path):
    path = write_jsonl(
        tmp_path / "some_bad.jsonl",
        [
            {"prompt": "good one"},
            "{not json",
            {"text": "no known field"},
            {"conversations": [{"from": "gpt", "value": "only an answer"}]},
            {"messages": [{"role": "user", "content": "   "}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "[1, 2]",
            "",
            {"prompt": "good two", "id": "x"},
        ],
    )
    prompts, report = read_all(path)
    assert [p.id for p in prompts] == ["some_bad:1", "x"]
    assert report.malformed == 6
    summary = report.summary()
    assert "skipped 6 malformed records" in summary and "line 2: not JSON" in summary


def test_file_without_a_usable_record_names_file_line_and_shape(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, {"text": "y"}])
    with pytest.raises(InvalidRequestError) as error:
        read_all(path)
    message = str(error.value)
    assert str(path) in message and "line 1" in message and '{"messages"' in message


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InvalidRequestError, match=r"empty\.jsonl is empty; expected one JSON object"):
        read_all(path)


def test_binary_file_is_an_error(tmp_path):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(b"\xff\xfe\x00\x81\n\x89PNG\n")
    with pytest.raises(InvalidRequestError, match="line 1: not UTF-8 text"):
        read_all(path)


def test_binary_json_array_is_an_error(tmp_path):
    path = tmp_path / "blob.json"
    path.write_bytes(b"[\xff\xfe\x00\x81]")
    with pytest.raises(InvalidRequestError, match="not UTF-8"):
        read_all(path)


def test_missing_source_is_an_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="no such file or directory"):
        read_all(tmp_path / "nope.jsonl")


def test_truncated_json_array_keeps_every_record_before_the_cut(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "dump.json"
    path.write_text(text[: text.rindex('"q2"') + 3])  # cut inside the last record
    prompts, report = read_all(path)
    assert [p.id for p in prompts] == ["r0", "r1"]
    assert report.malformed == 1 and "stopped reading there" in report.problems[0]


def test_json_array_of_only_bad_records_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"a": 1}, {"b": 2}]')
    with pytest.raises(InvalidRequestError, match="record 0"):
        read_all(path)


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "h1", "prompt": "first"}, {"id": "h2", "prompt": ""}, {"id": "h3", "prompt": "third"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "flat"))
    prompts, report = read_all(tmp_path / "flat")
    assert [p.id for p in prompts] == ["h1", "h3"] and report.malformed == 1
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:1]), test=datasets.Dataset.from_list(rows[2:])
    )
    splits.save_to_disk(str(tmp_path / "splits"))
    assert [p.id for p in read_all(tmp_path / "splits")[0]] == ["h1"]


def test_directory_that_is_no_dataset_is_an_error(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(InvalidRequestError, match="save_to_disk"):
        read_all(tmp_path)


def test_hf_directory_without_datasets_installed_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(InvalidRequestError, match="pip install datasets"):
        read_all(tmp_path)


def test_builtin_sharegpt_source_reads_records_with_their_ids():
    report = ReadReport(SHAREGPT)
    first = list(itertools.islice(read_source(SHAREGPT, report), 3))
    assert first[0].id == "QWJhYvA_0"
    assert all(p.messages[-1]["role"] == "user" and p.messages[-1]["content"] for p in first)


def test_repeated_ids_are_made_unique_and_duplicates_dropped(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "same"}, {"id": "x", "prompt": "other"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "prompt": "same"}])
    prompts, reports = read_sources([str(a), str(b)])
    assert [p.id for p in prompts] == ["x", "x#2", "x#3"]
    assert [r.prompts for r in reports] == [2, 1]
    kept, dropped = drop_duplicates(prompts)
    assert [p.id for p in kept] == ["x", "x#2"] and dropped == 1


CONVERSATION = {
    "id": "c",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Q1"},
        {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "   "},  # an empty later user turn is no prompt of its own
        {"from": "gpt", "value": "A2"},
        {"from": "human", "value": "Q3"},
        {"from": "gpt", "value": "A3"},
        {"from": "human", "value": "Q4"},  # unanswered: a prompt without a reply
        {"from": 5, "value": "broken"},  # a malformed later turn ends the conversation
        {"from": "human", "value": "never read"},
    ],
}


def test_all_turns_gives_a_prompt_per_user_turn_with_its_history(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [CONVERSATION])
    report = ReadReport(str(path))
    prompts = list(read_source(str(path), report, all_turns=True))
    assert [(p.id, p.turn, p.conversation_id, p.reply) for p in prompts] == [
        ("c", 1, "c", "A1"),
        ("c/turn-2", 2, "c", "A3"),
        ("c/turn-3", 3, "c", None),
    ]
    assert [m["content"] for m in prompts[1].messages] == ["Be brief.", "Q1", "A1", "   ", "A2", "Q3"]
    assert prompts[2].messages[-1] == {"role": "user", "content": "Q4"}
    assert (report.prompts, report.malformed) == (3, 0)
    assert read_all(path)[0] == prompts[:1]  # by default the first user turn only


@pytest.mark.parametrize("all_turns", [False, True])
def test_a_written_later_turn_reads_back_as_that_turn(tmp_path, all_turns):
    prompts = list(read_source(str(write_jsonl(tmp_path / "c.jsonl", [CONVERSATION])), ReadReport("c"), True))
    written = tmp_path / "written.jsonl"
    write_prompts(prompts, written)
    assert list(read_source(str(written), ReadReport("w"), all_turns)) == prompts


def test_a_bad_turn_field_is_a_malformed_record(tmp_path):
    records = [
        {**CONVERSATION, "turn": 0},
        {**CONVERSATION, "turn": 9},
        {**CONVERSATION, "id": "ok", "turn": 2},
    ]
    prompts, report = read_all(write_jsonl(tmp_path / "t.jsonl", records))
    assert [(p.id, p.turn) for p in prompts] == [("ok", 2)]
    assert report.malformed == 2
    assert "'turn' must be a positive integer" in report.problems[0]
    assert "fewer user turns" in report.problems[1]


def test_written_prompts_read_back_with_the_same_ids(tmp_path):
    prompts = [
        Prompt("s:1", [{"role": "user", "content": "héllo"}]),
        Prompt("s:2", [{"role": "user", "content": "b"}]),
    ]
    assert write_prompts(prompts, tmp_path / "out" / "p.jsonl") == 2
    assert read_all(tmp_path / "out" / "p.jsonl")[0] == prompts


def test_word_ngrams_ignore_case_punctuation_and_spacing():
    assert word_ngrams("Hello,  WORLD! foo_bar", 2) == {("hello", "world"), ("world", "foo"), ("foo", "bar")}


def test_eval_texts_hold_humaneval_prompts_and_both_mtbench_turns():
    texts = eval_texts()
    assert len(texts) == 164 + 2 * 80
    assert any("def has_close_elements" in t for t in texts)


def test_prompt_copying_a_humaneval_snippet_is_dropped():
    texts = eval_texts()
    snippet = next(t for t in texts if "def has_close_elements" in t)
    copied = Prompt("copy", [{"role": "user", "content": "Please solve:\n" + snippet.upper()[40:400]}])
    unrelated = Prompt("fresh", [{"role": "user", "content": "Tell me about the history of the bicycle."}])
    kept, dropped = decontaminate([copied, unrelated], texts, n=13)
    assert [p.id for p in kept] == ["fresh"] and dropped == 1


def test_decontamination_checks_every_turn_of_the_prompt():
    eval_text = " ".join(f"w{i}" for i in range(20))
    prompt = Prompt(
        "p",
        [
            {"role": "system", "content": "w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"},
            {"role": "user", "content": "hi"},
        ],
    )
    assert decontaminate([prompt], [eval_text], n=13) == ([], 1)
    assert decontaminate([prompt], [eval_text], n=14) == ([prompt], 0)
