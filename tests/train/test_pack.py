"""``diffdraft train pack``: the packed file holds exactly the samples the jsonl route trains on, keeps
held-out prompts out, and ``train fit`` / ``train eval`` read it directly."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from diffdraft.cli import main
from diffdraft.data.samples import Sample
from diffdraft.errors import InvalidRequestError
from diffdraft.train import cli as train_cli
from diffdraft.train.cli import run_train
from diffdraft.train.dataset import load_responses
from diffdraft.train.pack import check_packed_for, read_packed

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.training import parse_train_args

HELD_OUT = [Sample("bench-1", "sharegpt", messages=[{"role": "user", "content": "a bench prompt"}])]


@pytest.fixture(autouse=True)
def small_held_out_slice(monkeypatch):
    """The bench's real ShareGPT slice costs a read of the whole dump."""
    monkeypatch.setattr(train_cli, "sharegpt_held_out", lambda: HELD_OUT)


def chat(conversation_id, *turns):
    roles = ["human", "gpt"]
    return {
        "id": conversation_id,
        "conversations": [{"from": roles[i % 2], "value": text} for i, text in enumerate(turns)],
    }


@pytest.fixture
def setup(tmp_path):
    """A tiny target with a chat template, conversations with replies, and a held-out file."""
    target = make_checkpoint(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    tokenizer.save_pretrained(target)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "hello", "world"]
    chats = [
        chat(f"c{i}", " ".join(words[i:]), " ".join(words[: 4 + i] * 3), "and then?", " ".join(words))
        for i in range(6)
    ]
    chats.append(chat("bench-1", "a bench prompt", "kept out: the bench's own slice"))
    chats.append(chat("opening", "hi", "same opening as a held-out prompt", "more", "kept out too"))
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chats))
    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text(json.dumps({"id": "h", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return target, source, held_out


def pack(target, source, out, *extra):
    argv = ["train", "pack", "--source", str(source), "--target", str(target), "--all-turns"]
    run_train(parse_train_args([*argv, "--out", str(out), *extra]))


def test_pack_holds_the_samples_the_jsonl_route_trains_on_and_keeps_held_out_prompts_out(
    setup, tmp_path, capsys
):
    target, source, held_out = setup
    packed = tmp_path / "train.safetensors"
    pack(target, source, packed, "--max-length", "24", "--held-out-file", str(held_out))
    printed = capsys.readouterr().out
    assert "dropped 1 prompts of the bench's ShareGPT slice" in printed
    assert "dropped 2 prompts whose conversation opens as one in --held-out-file" in printed
    assert "packed 12 samples" in printed

    replies = tmp_path / "replies.jsonl"
    argv = ["train", "regenerate", "--source", str(source), "--target", str(target), "--all-turns"]
    run_train(parse_train_args([*argv, "--source-replies", "--out", str(replies)]))
    expected = [s for s in load_responses(replies, 24) if not s.sample_id.startswith("opening")]
    samples, info = read_packed(packed)
    assert info.max_length == 24 and info.samples == 12 and info.made_from["all_turns"]
    assert [s.sample_id for s in samples] == [s.sample_id for s in expected]
    assert any(s.token_ids.shape[0] == 24 for s in samples)  # long ones are cut as training cuts them
    for got, want in zip(samples, expected, strict=True):
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.response_start == want.response_start
    assert not any(s.sample_id.startswith(("bench-1", "opening")) for s in samples)

    # a regeneration output packs as it is
    again = tmp_path / "replies.safetensors"
    run_train(
        parse_train_args(
            [
                "train",
                "pack",
                "--responses",
                str(replies),
                "--target",
                str(target),
                "--out",
                str(again),
                "--max-length",
                "24",
            ]
        )
    )
    assert [s.token_ids.tolist() for s in read_packed(again)[0]] == [
        s.token_ids.tolist() for s in load_responses(replies, 24)
    ]


def test_fit_and_eval_read_a_packed_file_with_the_same_held_out_split(setup, tmp_path, capsys):
    target, source, _ = setup
    packed = tmp_path / "train.safetensors"
    pack(target, source, packed, "--max-length", "32")
    replies = tmp_path / "replies.jsonl"
    argv = ["train", "regenerate", "--source", str(source), "--target", str(target), "--all-turns"]
    run_train(parse_train_args([*argv, "--source-replies", "--out", str(replies)]))
    tokenizer = AutoTokenizer.from_pretrained(target)
    split = argparse.Namespace(data=str(packed), max_length=None, held_out=3)
    train, held = train_cli._split(split, tokenizer)
    assert split.max_length == 32  # the packed file's own length
    jsonl_train, jsonl_held = train_cli._split(
        argparse.Namespace(data=str(replies), max_length=32, held_out=3), tokenizer
    )
    assert [s.sample_id for s in held] == [s.sample_id for s in jsonl_held]
    assert [s.sample_id for s in train] == [s.sample_id for s in jsonl_train]

    out = tmp_path / "run"
    common = ["--data", str(packed), "--target", str(target), "--held-out", "3"]
    fit = ["train", "fit", *common, "--output-dir", str(out), "--num-layers", "1", "--block-size", "4"]
    fit += ["--batch-size", "2", "--max-steps", "2", "--mask-token-id", "5", "--target-layer-ids", "0", "1"]
    assert main(fit) == 0
    assert "training on 11 sequences (3 held out), 2 steps" in capsys.readouterr().out
    assert (out / "final" / "model.safetensors").is_file()
    report = tmp_path / "eval.json"
    evaluate = ["train", "eval", *common, "--drafter", str(out / "final"), "--budgets", "4"]
    assert main([*evaluate, "--max-new-tokens", "4", "--out", str(report)]) == 0
    assert len(json.loads(report.read_text())["accuracy_by_position"]) == 3

    assert main([*fit, "--max-length", "16"]) == 2
    assert "was packed with --max-length 32; train with that length" in capsys.readouterr().err


def test_bad_packed_files_and_options_are_clear_errors(setup, tmp_path):
    target, source, held_out = setup
    with pytest.raises(InvalidRequestError, match=r"must end in \.safetensors"):
        pack(target, source, tmp_path / "train.bin")
    packed = tmp_path / "train.safetensors"
    pack(target, source, packed)
    _, info = read_packed(packed)
    with pytest.raises(InvalidRequestError, match="packed with another tokenizer"):
        check_packed_for(info, packed, info.max_length, "sha256:0123456789abcdef")
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, other)
    with pytest.raises(InvalidRequestError, match="not packed training data"):
        read_packed(other)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        read_packed(tmp_path / "missing.safetensors")
    with pytest.raises(InvalidRequestError, match="packed as they are"):
        pack(target, source, packed, "--responses", str(source), "--held-out-file", str(held_out))
