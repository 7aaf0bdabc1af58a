"""Incremental decoding gives exactly the text of one full decode, whatever the round sizes."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from diffdraft.runtime.detokenize import IncrementalDecoder

from diffdraft_testing.checkpoints import tiny_tokenizer

CORPUS = ["héllo wörld, the quick brown fox 日本語 😀", "def f(x):\n    return x ** 2  # naïve café"]


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Metaspace pre-tokenizer and decoder, as Llama-2 / Mistral tokenizers: a decode drops the
    leading space of its first word, so decoding a tail alone would lose a space."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("make_tokenizer", [tiny_tokenizer, sentencepiece_like])
def test_every_step_equals_a_full_decode(make_tokenizer):
    tokenizer = make_tokenizer()

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    texts = [tokenizer(" ".join(CORPUS * 3))["input_ids"]]
    texts += [[rng.randrange(len(tokenizer)) for _ in range(120)] for _ in range(30)]  # cut characters too
    for ids in texts:
        decoder = IncrementalDecoder(decode)
        end = 0
        while end < len(ids):
            end = min(len(ids), end + rng.randint(0, 6))
            assert decoder(ids[:end]) == decode(ids[:end])


def test_a_call_that_does_not_extend_the_last_one_is_decoded_in_full():
    tokenizer = sentencepiece_like()
    ids = tokenizer(CORPUS[1])["input_ids"]

    def decode(seen):
        return tokenizer.decode(seen, skip_special_tokens=True)

    decoder = IncrementalDecoder(decode)
    decoder(ids)
    assert decoder(ids[:3]) == decode(ids[:3])
    other = ids[::-1]
    assert decoder(other) == decode(other)
    assert decoder(other + ids) == decode(other + ids)
