"""The tokenizer fingerprint that drafters and n-gram tries record."""

from __future__ import annotations

from transformers import AutoTokenizer

from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import tiny_tokenizer


def test_fingerprint_is_stable_across_loads_and_differs_between_tokenizers(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    first = AutoTokenizer.from_pretrained(tmp_path / "tok")
    second = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)
    assert tokenizer_fingerprint(first).startswith("sha256:")
    second.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(first) != tokenizer_fingerprint(second)
