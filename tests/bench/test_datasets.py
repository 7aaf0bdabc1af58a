"""Benchmark datasets: the built-in sets and every record shape a user jsonl may hold."""

from __future__ import annotations

import json

import pytest

import diffdraft.data.samples
from diffdraft.bench.datasets import load_samples, spread
from diffdraft.errors import InvalidRequestError


def test_humaneval_is_164_chat_requests_holding_the_function():
    samples = load_samples("humaneval")
    assert len(samples) == 164
    first = samples[0]
    assert first.id == "HumanEval/0" and first.turns == 1
    assert "def has_close_elements" in first.messages[0]["content"]


def test_mtbench_questions_are_two_turn_chats_spread_over_categories():
    samples = load_samples("mtbench", 4)
    assert [s.id for s in samples] == ["81", "101", "121", "141"]
    assert all(s.turns == 2 and s.messages[0]["role"] == "user" for s in samples)


def test_spread_picks_evenly_and_keeps_short_lists():
    assert spread(list(range(10)), 3) == [0, 3, 6]
    assert spread([1, 2], 5) == [1, 2]


def test_every_jsonl_record_shape(tmp_path):
    path = tmp_path / "mine.jsonl"
    records = [
        {"prompt": "def f(x):"},
        {
            "id": "chat",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        },
        {"turns": ["First?", "And then?"]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    plain, chat, turns, sharegpt = load_samples(str(path))
    assert plain.prompt == "def f(x):" and plain.messages is None and plain.dataset == "mine"
    assert chat.id == "chat" and [m["role"] for m in chat.messages] == ["system", "user"]
    assert turns.messages == [{"role": "user", "content": "First?"}] and turns.followups == ["And then?"]
    assert sharegpt.messages == [{"role": "user", "content": "Q"}]  # cut after the first user turn
    assert sharegpt.id == "mine:4"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "x"}', "no 'prompt', 'turns'"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "must end with a user turn"),
        ("not json", "mine.jsonl:1"),
    ],
)
def test_a_malformed_line_is_an_error_naming_it(tmp_path, line, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InvalidRequestError, match=message):
        load_samples(str(path))


def test_the_sharegpt_slice_is_the_tail_of_the_dump(tmp_path, monkeypatch):
    dump = tmp_path / "dump.json"
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(8)]
    dump.write_text(json.dumps(records))
    monkeypatch.setattr(diffdraft.data.samples, "sharegpt_path", lambda: dump)
    monkeypatch.setattr(diffdraft.data.samples, "SHAREGPT_HELD_OUT", 3)
    assert [s.id for s in load_samples("sharegpt")] == ["c5", "c6", "c7"]


def test_a_line_that_is_not_utf8_is_an_error_naming_it_and_the_lines_before_are_fine(tmp_path):
    path = tmp_path / "mine.jsonl"
    good = json.dumps({"prompt": "héllo"}).encode() + b"\n"
    path.write_bytes(good + b'{"prompt": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(InvalidRequestError, match=r"mine.jsonl:2: 'utf-8' codec can't decode byte 0xe9"):
        load_samples(str(path))
    path.write_bytes(good)
    assert [s.prompt for s in load_samples(str(path))] == ["héllo"]
