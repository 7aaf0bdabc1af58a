"""Tiny random models built from configs: every test runs in seconds on a 2-core CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.dart_model import DARTDraftModel, make_dart_config
from diffdraft.drafters.dflash_model import DFLASH, DFlashDraftModel, make_draft_config
from diffdraft.kernels.packed_linear import packing_supported
from diffdraft.kernels.quantized.kernel_build import cpu_supported
from diffdraft.train.batch import TrainingBatch, pad_right

# Tiny models are dominated by per-op overhead: one thread is several times faster than two.
torch.set_num_threads(1)

needs_packing = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 on this CPU"
)
"""For tests of diffdraft's packed CPU kernels."""

needs_block_kernel = pytest.mark.skipif(not cpu_supported(), reason="no AVX2 on this CPU")
"""For tests of the Q4_1 kernel (:mod:`diffdraft.kernels.quantized`)."""

FAMILIES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "mistral": MistralConfig,
    "phi3": Phi3Config,
}


def tiny_target(
    family: str = "llama",
    seed: int = 0,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 4,
    max_positions: int = 256,
    dtype: torch.dtype = torch.float64,
    init_std: float = 0.2,
    **config_overrides,
) -> torch.nn.Module:
    """A random causal LM. float64 by default so greedy ties never depend on kernel rounding.

    The large init std makes next-token distributions peaked, like a real model's, so drafts get
    accepted and long accepted paths are exercised.
    """
    config = FAMILIES[family](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=config_overrides.pop("tie_word_embeddings", False),
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
        **config_overrides,
    )
    torch.manual_seed(seed)
    attention = "eager" if family == "gemma2" else "sdpa"  # Gemma 2's attention soft-capping has no SDPA
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.to(dtype).eval()


WINDOWED_FAMILIES = ("gemma2", "gemma3", "mistral", "phi3", "qwen2", "qwen3")
"""Families :func:`windowed_target` builds with sliding-window layers."""


def windowed_target(family: str, window: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """:func:`tiny_target` of ``family`` with windows of ``window`` keys: Gemma 2 alternating windowed
    and full layers, Gemma 3 one full layer in four (the third), windowed Qwen2 and Qwen3 their last
    two layers, Mistral and Phi-3 every layer."""
    layers = overrides.pop("layers", 4)
    hybrid = {
        "gemma2": dict(layer_types=["sliding_attention", "full_attention"] * (layers // 2)),
        "gemma3": dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        ),
        "qwen2": dict(use_sliding_window=True, max_window_layers=layers - 2),
        "qwen3": dict(use_sliding_window=True, max_window_layers=layers - 2),
    }
    config = {**hybrid.get(family, {}), "sliding_window": window, **overrides}
    return tiny_target(family, seed=seed, layers=layers, **config)


def ignore_windows(monkeypatch) -> None:
    """Make every target built from now on attend as if it had no sliding window (masks and the rows
    its forward reads alike): what a verifier that ignored the window would compute."""
    from diffdraft.kernels.attention_window import FULL, LayerWindows

    def windowless(cls, config):
        return cls(types=(FULL,) * config.num_hidden_layers, window=None, by_type=False)

    monkeypatch.setattr(LayerWindows, "of", classmethod(windowless))


def slow_after_bigger_forwards():
    """A stand-in for timing one round (``(target, cache or caches, tokens) -> seconds``) on a machine
    whose one-token forward takes 4 ms right after a bigger one and comes down 1 ms a round to 1 ms
    in a run; a bigger forward takes 10 ms."""
    since_bigger = [0]

    def time_round(target, cache, tokens: torch.Tensor) -> float:
        if tokens.shape[0] > 1:
            since_bigger[0] = 0
            return 0.01
        since_bigger[0] += 1
        return 0.001 * max(1, 5 - since_bigger[0])

    return time_round


def tiny_drafter(
    target: torch.nn.Module,
    seed: int = 0,
    layers: int = 1,
    block_size: int = 4,
    variant: str = DFLASH,
    target_layer_ids: list[int] | None = None,
    draft_vocab: list[int] | None = None,
) -> DFlashDraftModel:
    """A random drafter; ``draft_vocab`` restricts it to scoring only those target tokens."""
    config = make_draft_config(
        target.config,
        num_layers=layers,
        block_size=block_size,
        mask_token_id=target.config.vocab_size - 2,
        target_layer_ids=target_layer_ids or [0, target.config.num_hidden_layers - 1],
        variant=variant,
        draft_vocab_size=len(draft_vocab or []),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).to(target.dtype)
    if draft_vocab:
        model.draft_vocab.copy_(torch.tensor(sorted(draft_vocab)))
    return model


def save_tiny_drafter(checkpoint: Path, path: Path) -> Path:
    """:func:`tiny_drafter` (block 4, float32) for a saved checkpoint's model, saved under ``path``."""
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    save_draft_model(tiny_drafter(target, block_size=4).float(), path)
    return path


def tiny_dart(
    target: torch.nn.Module,
    seed: int = 0,
    draft_length: int = 3,
    draft_vocab: list[int] | None = None,
    init_std: float = 0.2,
) -> DARTDraftModel:
    """A random DART drafter tapping three target layers; ``draft_vocab`` restricts its head."""
    layers = target.config.num_hidden_layers
    config = make_dart_config(
        target.config,
        draft_length=draft_length,
        target_layer_ids=[0, layers // 2, layers - 1],
        draft_vocab_size=len(draft_vocab or []),
    )
    config.initializer_range = init_std  # peaked draft distributions, like a trained drafter's
    torch.manual_seed(seed)
    model = DARTDraftModel(config).to(target.dtype)
    if draft_vocab:
        model.set_draft_vocab(torch.tensor(draft_vocab))
    return model


def sequences_batch(sequences: list[tuple]) -> TrainingBatch:
    """A training batch from (token_ids, anchors, taps or None, target logits or None, response start)
    per sequence, right-padded as the trainer pads."""

    def stacked(k: int) -> torch.Tensor | None:
        return None if sequences[0][k] is None else pad_right([s[k] for s in sequences])

    return TrainingBatch(
        stacked(0),
        [s[0].shape[0] for s in sequences],
        [s[1] for s in sequences],
        [s[4] for s in sequences],
        stacked(2),
        stacked(3),
    )


def assert_batch_matches_each_sequence(
    objective: torch.nn.Module, sequences: list[tuple], gamma: float
) -> None:
    """One padded forward over ``sequences`` gives the mean of their losses and the sums of their
    statistics, as each alone does."""
    with torch.no_grad():
        alone = [objective(sequences_batch([sequence]), gamma) for sequence in sequences]
        loss, hits, agreements, counts = objective(sequences_batch(sequences), gamma)
    torch.testing.assert_close(loss, torch.stack([a[0] for a in alone]).mean())
    for k, batched in ((1, hits), (2, agreements), (3, counts)):
        assert batched.tolist() == sum(a[k] for a in alone).tolist()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """The reference: transformers' own greedy generate, generated tokens only."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


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


class PerContextLookups:
    """``log_probs_many`` for N-gram test doubles that define ``log_probs`` (one context) only."""

    def log_probs_many(self, contexts, tokens):
        return np.stack([self.log_probs(context, tokens) for context in contexts]).reshape(len(contexts), -1)


def q4_1_blocks(weight: torch.Tensor):
    """``weight`` quantized to GGUF Q4_1 blocks by the reference quantizer of the ``gguf`` package."""
    from gguf import GGMLQuantizationType, quants

    from diffdraft.kernels.quantized.block_linear import BlockWeight

    raw = quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q4_1)
    return BlockWeight.from_gguf(raw)


def speculated_tokens(target, drafter, builder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy tokens the engine commits for ``prompt`` with ``drafter`` (None: plain decoding) and
    tree ``builder``, stopping at EOS or ``max_new_tokens``."""
    from diffdraft.decoding.engine import SpeculativeEngine
    from diffdraft.decoding.sequence_spec import SequenceSpec
    from diffdraft.runtime.stopping import StopConditions

    config = target.model.config
    stop = StopConditions([config.eos_token_id], max_new_tokens, config.max_position_embeddings, len(prompt))
    engine = SpeculativeEngine(target, drafter, builder)
    return [t for chunk in engine.run(SequenceSpec(prompt, stop)) for t in chunk]


def int8_rounded_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's rounding of inputs ``x`` [..., in]: each row's blocks of 32 as codes
    round(x * 127 / max|x|) in float32 (the kernel's codes exactly) [rows, blocks, 32], and their scales
    max|x| / 127 [rows, blocks], both as float64."""
    x = x.float().reshape(-1, x.shape[-1] // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, 0)  # (127 / amax would be amax^-1 * 127)
    return torch.round(x * inverse).double(), (amax / 127).double()[..., 0]


GGUF_FLOAT16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
"""Byte offsets of each format's float16 scales (d, and dmin or m) within a GGUF block."""


def random_gguf_bytes(format: str, out: int, inputs: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """A GGUF tensor [out, bytes per row] of random bytes (every code, sub-scale and min a file may
    hold) whose float16 fields are normal values of std ``scale``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    block_inputs, size = GGML_QUANT_SIZES[GGMLQuantizationType[format]]
    raw = rng.integers(0, 256, (out, inputs // block_inputs, size), dtype=np.uint8)
    for offset in GGUF_FLOAT16_FIELDS[format]:
        values = (rng.standard_normal((out, inputs // block_inputs)) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def write_random_gguf(path: Path, model: torch.nn.Module, formats: dict[str, str], seed: int = 0) -> None:
    """``model`` (a Qwen2) as a GGUF whose decoder-layer tensors ``blk.N.<key>`` are random blocks of
    ``formats[key]`` (a key missing there keeps its layer dense: an F32 tensor), and its LM head
    ``output`` of ``formats["output"]`` if given, the model's own weights set to what the file holds;
    the embedding stays dense."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from diffdraft.kernels.quantized.gguf_weights import LAYER_TENSORS

    writer = GGUFWriter(str(path), "qwen2")
    for i, layer in enumerate(model.model.layers):
        for key, name in LAYER_TENSORS.items():
            linear = layer.get_submodule(name)
            if key not in formats:
                writer.add_tensor(f"blk.{i}.{key}.weight", linear.weight.detach().float().numpy())
                continue
            kind = GGMLQuantizationType[formats[key]]
            raw = random_gguf_bytes(
                formats[key], *linear.weight.shape, seed=seed * 1000 + 10 * i + len(key), scale=2e-3
            )
            linear.weight.data = torch.from_numpy(quants.dequantize(raw, kind)).to(linear.weight.dtype)
            writer.add_tensor(f"blk.{i}.{key}.weight", raw, raw_dtype=kind)
    if "output" in formats:
        kind = GGMLQuantizationType[formats["output"]]
        raw = random_gguf_bytes(formats["output"], *model.lm_head.weight.shape, seed=seed, scale=2e-3)
        model.lm_head.weight.data = torch.from_numpy(quants.dequantize(raw, kind)).to(
            model.lm_head.weight.dtype
        )
        writer.add_tensor("output.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def q4_1_target(family: str = "llama", seed: int = 0, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target whose decoder-layer weights are Q4_1 blocks: (bf16 model on
    :class:`BlockQuantizedLinear` layers, float32 dense model of the same weights)."""
    from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear

    kwargs.setdefault("hidden", 64)  # block-quantized widths are multiples of 32
    dense = tiny_target(family, seed=seed, dtype=torch.float32, **kwargs)
    model = tiny_target(family, seed=seed, dtype=torch.bfloat16, **kwargs)
    for name, linear in list(dense.model.layers.named_modules()):
        if isinstance(linear, torch.nn.Linear):
            blocks = q4_1_blocks(linear.weight)
            linear.weight.data = blocks.dequantize()
            parent_name, _, attribute = name.rpartition(".")
            parent = model.model.layers.get_submodule(parent_name)
            setattr(parent, attribute, BlockQuantizedLinear(blocks, getattr(parent, attribute).bias))
    return model, dense


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    """Command-line arguments ``["train", ...]`` as ``diffdraft`` parses them."""
    from diffdraft.train.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="diffdraft")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
