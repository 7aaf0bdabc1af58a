"""``diffdraft ngram build|info`` on a tiny checkpoint's tokenizer; errors exit 2 with one line."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from diffdraft.cli import main
from diffdraft.ngram import NgramTrie

from diffdraft_testing.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "corpus.jsonl"
    records = [
        {"prompt": "hello world, the quick brown fox"},
        {
            "messages": [
                {"role": "user", "content": "the quick fox"},
                {"role": "assistant", "content": "hello"},
            ]
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def build_args(checkpoint, source, out, *extra):
    return [
        "ngram",
        "build",
        "--target",
        str(checkpoint),
        "--source",
        source,
        "--out",
        str(out),
        "--no-decontaminate",
        "--no-progress",
        *extra,
    ]


def test_build_then_info(checkpoint, source, tmp_path, capsys):
    out = tmp_path / "trie"
    assert main(build_args(checkpoint, source, out, "--min-count", "1", "--order", "2")) == 0
    printed = capsys.readouterr().out
    assert "read 2 records" in printed and f"wrote {out}" in printed
    trie = NgramTrie.load(out)
    assert trie.order == 2 and trie.meta["min_count"] == 1
    trie.check_tokenizer(AutoTokenizer.from_pretrained(checkpoint))  # the target's tokenizer fits

    assert main(["ngram", "info", str(out)]) == 0
    info = capsys.readouterr().out
    for line in ("order: 2", f"vocab size: {trie.vocab_size}", trie.tokenizer_hash, "bytes on disk: "):
        assert line in info
    assert f"tokens: {trie.token_count}" in info
    assert "nodes per level: " + ", ".join(map(str, trie.nodes_per_level)) in info


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffdraft: error: ")
    return err[0]


def test_info_on_a_missing_trie_exits_2(tmp_path, capsys):
    assert main(["ngram", "info", str(tmp_path / "nowhere")]) == 2
    assert "diffdraft ngram build" in _one_line_error(capsys)


def test_build_refusing_an_occupied_out_exits_2(checkpoint, source, tmp_path, capsys):
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(build_args(checkpoint, source, out)) == 2
    assert "--force" in _one_line_error(capsys)
    assert main(build_args(checkpoint, source, out, "--force")) == 0


def test_build_with_a_missing_target_or_source_exits_2(checkpoint, source, tmp_path, capsys):
    assert main(build_args(tmp_path / "no-model", source, tmp_path / "t")) == 2
    assert "--target" in _one_line_error(capsys)
    assert main(build_args(checkpoint, str(tmp_path / "no.jsonl"), tmp_path / "t")) == 2
    assert "no such file" in _one_line_error(capsys)
    assert not (tmp_path / "t").exists()
