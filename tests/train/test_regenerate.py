"""Regeneration with a tiny random target: records, left padding, skipping, and kill-and-resume."""

from __future__ import annotations

import fcntl
import json

import pytest
import torch
from transformers import AutoTokenizer

from diffdraft.data.prompts import Prompt
from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.chat import encode_chat
from diffdraft.train import regenerate as regen_module
from diffdraft.train.regenerate import (
    SampleWriter,
    _RowEndWatcher,
    encode_for_target,
    finished_ids,
    fit_history,
    length_sorted_batches,
    regenerate,
)

from diffdraft_testing.checkpoints import make_checkpoint

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
FIELDS = {"id", "messages", "prompt_token_ids", "response_token_ids", "response", "finish_reason"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama with a chat template, saved like a hub download."""
    path = make_checkpoint(tmp_path_factory.mktemp("target"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


PROMPTS = [
    Prompt("a", user("hello")),
    Prompt("b", user("the quick brown fox, hello world")),
    Prompt("c", [{"role": "system", "content": "be brief"}, *user("fox")]),
    Prompt("d", user("world world world world world")),
    Prompt("e", user("brown")),
]


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(target, path, prompts=PROMPTS, **options):
    options = {"max_new_tokens": 6, "batch_size": 2, "dtype": "float32", "progress": False, **options}
    return regenerate(target, prompts, path, **options)


def test_every_prompt_gets_one_complete_record(target, tmp_path):
    out = tmp_path / "sub" / "responses.jsonl"
    report = run(target, out)
    records = read_records(out)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert sorted(r["id"] for r in records) == ["a", "b", "c", "d", "e"]
    for record in records:
        prompt = next(p for p in PROMPTS if p.id == record["id"])
        assert set(record) == FIELDS
        assert record["messages"] == prompt.messages
        assert record["prompt_token_ids"] == encode_chat(tokenizer, prompt.messages)
        assert 1 <= len(record["response_token_ids"]) <= 6
        assert record["finish_reason"] in ("eos", "max_new_tokens")
        if record["finish_reason"] == "max_new_tokens":
            assert len(record["response_token_ids"]) == 6
        assert record["response"] == tokenizer.decode(record["response_token_ids"], skip_special_tokens=True)
    assert (report.written, report.already_done, report.too_long) == (5, 0, 0)
    assert report.generated_tokens == sum(len(r["response_token_ids"]) for r in records)


def test_left_padded_batches_give_the_unbatched_greedy_tokens(target, tmp_path):
    run(target, tmp_path / "one.jsonl", temperature=0, batch_size=1)
    run(target, tmp_path / "five.jsonl", temperature=0, batch_size=5)
    alone = {r["id"]: r["response_token_ids"] for r in read_records(tmp_path / "one.jsonl")}
    batched = {r["id"]: r["response_token_ids"] for r in read_records(tmp_path / "five.jsonl")}
    assert alone == batched


def test_long_prompts_are_skipped_and_counted(target, tmp_path):
    out = tmp_path / "r.jsonl"
    report = run(target, out, max_prompt_tokens=12)
    kept = [r["id"] for r in read_records(out)]
    assert report.too_long == 5 - len(kept) > 0
    assert all(len(r["prompt_token_ids"]) <= 12 for r in read_records(out))


def test_a_later_turn_over_the_prompt_budget_drops_its_oldest_exchanges(target):
    tokenizer = AutoTokenizer.from_pretrained(target)
    system = {"role": "system", "content": "be brief"}
    history = [*user("one two three four five six"), {"role": "assistant", "content": "seven eight nine"}]
    later = Prompt("x/turn-3", [system, *history, *history, *user("fox")], turn=3, conversation="x")
    whole = encode_for_target(tokenizer, later)
    alone = encode_for_target(tokenizer, Prompt("y", [system, *user("fox")]))
    fitted, ids = fit_history(tokenizer, later, len(whole) - 1)
    assert fitted.messages == [system, *history, *user("fox")] and len(ids) < len(whole)
    assert (fitted.id, fitted.turn) == ("x/turn-3", 3)
    fitted, ids = fit_history(tokenizer, later, len(alone))
    assert fitted.messages == [system, *user("fox")] and ids == alone
    _, ids = fit_history(tokenizer, later, len(alone) - 1)  # still over: the caller skips it
    assert len(ids) == len(alone)


def test_kill_and_resume_keeps_every_finished_sample_exactly_once(target, tmp_path, monkeypatch):
    out = tmp_path / "r.jsonl"
    original_write = SampleWriter.write
    calls = []

    def dying_write(self, *args):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the kill arrives while the rest of the batch is still running
        calls.append(args[0].id)
        original_write(self, *args)

    monkeypatch.setattr(SampleWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(target, out)
    before_kill = out.read_text().splitlines()
    assert len(before_kill) == 3
    with out.open("a") as f:
        f.write('{"id": "x", "messages": [{"ro')  # the kill cut the next line in half
    monkeypatch.setattr(SampleWriter, "write", original_write)

    report = run(target, out)

    lines = out.read_text().splitlines()
    assert lines[:3] == before_kill  # no finished sample lost or rewritten
    assert sorted(json.loads(line)["id"] for line in lines) == ["a", "b", "c", "d", "e"]
    assert (report.already_done, report.written) == (3, 2)


def test_a_cut_line_is_dropped_even_when_it_is_valid_json(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b"}')
    assert finished_ids(out) == {"a"}
    assert out.read_text() == '{"id": "a"}\n'


def test_a_corrupt_line_before_the_end_is_an_error(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(InvalidRequestError, match="line 2 is not a regenerated sample"):
        finished_ids(out)


def test_nothing_to_do_loads_no_model(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps({"id": p.id}) + "\n" for p in PROMPTS))
    report = regenerate("/no/such/model", PROMPTS, out)
    assert (report.already_done, report.written) == (5, 0)


def test_bad_options_fail_before_loading(tmp_path):
    for options in ({"temperature": -1}, {"top_p": 0}, {"batch_size": 0}, {"max_new_tokens": 0}):
        with pytest.raises(InvalidRequestError):
            regenerate("/no/such/model", PROMPTS, tmp_path / "r.jsonl", **options)


def test_target_without_chat_template_takes_single_turn_prompts_as_text(tmp_path):
    target = make_checkpoint(tmp_path / "base")
    out = tmp_path / "r.jsonl"
    run(target, out, prompts=PROMPTS[:2])
    tokenizer = AutoTokenizer.from_pretrained(target)
    record = next(r for r in read_records(out) if r["id"] == "a")
    assert record["prompt_token_ids"] == tokenizer("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidRequestError, match=r"prompt 'c'.*no chat template"):
        run(target, tmp_path / "r2.jsonl", prompts=PROMPTS[2:3])


def test_rows_are_handed_over_at_the_step_they_end():
    ended = []
    watcher = _RowEndWatcher(2, [9], 3, lambda row, ids, reason: ended.append((row, ids, reason)))
    steps = [[[0, 0, 5], [0, 0, 9]], [[0, 0, 5, 9], [0, 0, 9, 9]], [[0, 0, 5, 9, 9], [0, 0, 9, 9, 9]]]
    third_row = [[0, 0, 1], [0, 0, 1, 2], [0, 0, 1, 2, 3]]
    for step, extra in zip(steps, third_row, strict=True):
        result = watcher(torch.tensor([*step, extra]), None)
        assert not result.any()  # generate's own criteria stop rows; the watcher only reports them
    assert ended == [(1, [9], "eos"), (0, [5, 9], "eos"), (2, [1, 2, 3], "max_new_tokens")]


def test_batches_sort_by_length_within_windows(monkeypatch):
    monkeypatch.setattr(regen_module, "SORT_WINDOW_BATCHES", 2)
    items = [(Prompt(str(i), user("x")), [0] * length) for i, length in enumerate([1, 5, 3, 2, 9, 4, 7])]
    batches = length_sorted_batches(items, 2)
    assert [[len(ids) for _, ids in batch] for batch in batches] == [[5, 3], [2, 1], [9, 7], [4]]


def test_a_second_run_on_the_same_file_is_refused(tmp_path):
    out = tmp_path / "r.jsonl"
    with out.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # as a run still going would hold it
        with pytest.raises(InvalidRequestError, match="another run is writing"):
            regenerate("/no/such/model", PROMPTS, out)
    assert regenerate("/no/such/model", [], out).written == 0
