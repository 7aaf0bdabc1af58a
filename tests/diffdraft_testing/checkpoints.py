"""Tiny models saved on disk like hub downloads (weights, config, tokenizer), and drafters saved for them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.ngram.build import build_from_sources
from diffdraft.target.loading import load_target
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.drafters import tiny_dart, tiny_drafter
from diffdraft_testing.targets import FAMILIES


def save_tiny_drafter(checkpoint: Path, path: Path) -> Path:
    """:func:`tiny_drafter` (block 4, float32) for a saved checkpoint's model, saved under ``path``."""
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    save_draft_model(tiny_drafter(target, block_size=4).float(), path)
    return path


CHECKPOINT_VOCAB = 320


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE like real Llama/Qwen ones: transformers 5 rebuilds a Qwen2 tokenizer's pipeline
    as byte-level BPE from its vocab, so a WordLevel fixture would encode to nothing after reloading."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world, the quick brown fox"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def make_checkpoint(path: Path, family: str = "llama", dtype: torch.dtype = torch.float32) -> Path:
    """A random 2-layer model of the family, saved like a hub download (weights + config + tokenizer)."""
    config = FAMILIES[family](
        vocab_size=CHECKPOINT_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,  # Phi-3's default (32000) lies outside the vocabulary
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_dart_and_trie(target: Path, root: Path) -> tuple[Path, Path]:
    """A random DART drafter for a tiny saved target and a 3-gram trie built with its tokenizer."""
    loaded = load_target(target)
    save_draft_model(tiny_dart(loaded.model, draft_length=4).float(), root / "dart")
    corpus = root / "corpus.jsonl"
    texts = ["hello world, the quick", "the quick brown fox", "hello fox, the brown world"]
    corpus.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    build_from_sources(
        loaded.tokenizer, [str(corpus)], root / "trie", min_count=1, decontaminate=False, progress=False
    )
    return root / "dart", root / "trie"


def save_deer(target: Path, path: Path) -> Path:
    """A DEER drafter cut from a tiny saved target's first layer, recording its tokenizer."""
    loaded = load_target(target)
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    save_draft_model(deer_from_causal_lm(loaded.model, 1, 4, 0, fingerprint, "tiny target"), path)
    return path
