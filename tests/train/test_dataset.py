"""Reading regenerated responses into training sequences."""

from __future__ import annotations

import json

import pytest

from diffdraft.errors import InvalidRequestError
from diffdraft.train.dataset import load_responses


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def record(i, prompt_len, response_len):
    return {
        "id": f"s{i}",
        "prompt_token_ids": list(range(prompt_len)),
        "response_token_ids": list(range(1000, 1000 + response_len)),
    }


def test_long_sequences_keep_the_response_and_the_end_of_the_prompt(tmp_path):
    path = write(tmp_path / "r.jsonl", [record(0, 500, 384), record(1, 50, 384), record(2, 10, 20)])
    long_prompt, long_response, short = load_responses(path, max_length=384)
    assert long_prompt.response_start == 96  # a quarter of the window for the prompt
    assert long_prompt.token_ids[:96].tolist() == list(range(404, 500))
    assert long_prompt.token_ids[96:].tolist() == list(range(1000, 1288))
    assert long_response.response_start == 50 and long_response.token_ids.shape[0] == 384
    assert short.token_ids.tolist() == list(range(10)) + list(range(1000, 1020))


def test_a_half_written_last_line_and_short_responses_are_skipped(tmp_path):
    path = write(tmp_path / "r.jsonl", [record(0, 5, 10), record(1, 5, 1)], tail='{"id": "s2", "prom')
    assert [s.sample_id for s in load_responses(path, max_length=64)] == ["s0"]


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        load_responses(tmp_path / "missing.jsonl", 64)
    bad = write(tmp_path / "bad.jsonl", [{"id": "x", "prompt_token_ids": [1]}])
    with pytest.raises(InvalidRequestError, match=r"bad\.jsonl:1 is not a regenerated sample"):
        load_responses(bad, 64)
    empty = write(tmp_path / "empty.jsonl", [])
    with pytest.raises(InvalidRequestError, match="no usable training sample"):
        load_responses(empty, 64)
