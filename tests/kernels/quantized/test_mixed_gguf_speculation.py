"""A GGUF that mixes block formats, as a Q4_K_M file does, loads each tensor onto its own format's
kernel, and every method's greedy tokens on it are our own plain decoding's, token for token; a
drafter beside it drafts on Q4_1 blocks, the target's head rows it borrows included."""

from __future__ import annotations

import pytest
import torch

from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear, block_kernels
from diffdraft.kernels.quantized.gguf_weights import use_gguf_blocks
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.engine import speculated_tokens
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import write_random_gguf
from diffdraft_testing.targets import tiny_target

MIXES = {
    # each projection its own format: q|k|v and gate|up stacked across formats
    "every format": {
        "attn_q": "Q4_K",
        "attn_k": "Q5_K",
        "attn_v": "Q6_K",
        "attn_output": "Q4_0",
        "ffn_gate": "Q5_0",
        "ffn_up": "Q8_0",
        "ffn_down": "Q4_1",
        "output": "Q6_K",
    },
    # siblings share a format, as most of a Q4_K_M file's layers do
    "siblings alike": {
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q4_K",
        "attn_output": "Q5_0",
        "ffn_gate": "Q6_K",
        "ffn_up": "Q6_K",
        "ffn_down": "Q5_K",
    },
}


@needs_block_kernel
@pytest.mark.parametrize("mix", MIXES)
def test_every_method_on_a_mixed_format_file_is_plain_decoding_token_for_token(tmp_path, mix):
    model = tiny_target("qwen2", seed=3, vocab=96, hidden=256, layers=2, dtype=torch.bfloat16)
    write_random_gguf(tmp_path / "mixed.gguf", model, MIXES[mix])
    assert len(use_gguf_blocks(model, tmp_path / "mixed.gguf")) == 7 * 2 + ("output" in MIXES[mix])
    assert block_kernels(model) == sorted(f"{format}/int8" for format in set(MIXES[mix].values()))
    fuse_projections(model)
    target = TargetModel(model)
    assert target.lean is not None and target.lean.fused is not None  # the fused decoder loop runs
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 95, (length,), generator=generator).tolist() for length in (1, 9, 30)]
    draft_vocab = list(range(0, 96, 2))  # the drafter borrows these rows of the target's head
    drafter = DFlashDrafter(tiny_drafter(model, 3, block_size=5, draft_vocab=draft_vocab), target)
    drafted = [m for m in drafter.model.layers.modules() if isinstance(m, BlockQuantizedLinear)]
    if "output" in MIXES[mix]:  # the target's head on blocks: the rows it lends are rounded to Q4_1 too
        drafted.append(drafter.head)
    assert drafted and all(m.blocks.format == "Q4_1" for m in drafted)  # as beside a Q4_1 target
    methods = {
        "chain": (drafter, ChainBuilder()),
        "ddtree": (drafter, DDTreeBuilder(12)),
        "ddtree+pld": (LookupBoostedDrafter(drafter), DDTreeBuilder(6)),
    }
    for prompt in prompts:
        reference = speculated_tokens(target, None, ChainBuilder(), prompt, 24)
        for name, (method_drafter, builder) in methods.items():
            assert speculated_tokens(target, method_drafter, builder, prompt, 24) == reference, (
                name,
                len(prompt),
            )


@needs_block_kernel
def test_tensors_of_formats_without_a_kernel_stay_dense_and_are_named(tmp_path, capsys):
    model = tiny_target("qwen2", seed=1, vocab=96, hidden=256, layers=2, dtype=torch.bfloat16)
    formats = dict(MIXES["siblings alike"])
    del formats["ffn_down"]  # written as F32
    formats["attn_output"] = "Q5_1"
    write_random_gguf(tmp_path / "partly.gguf", model, formats)
    assert len(use_gguf_blocks(model, tmp_path / "partly.gguf")) == 5 * 2
    err = capsys.readouterr().err
    assert "4 linear layers of partly.gguf stay dense" in err
    assert "F32: blk.0.ffn_down.weight, blk.1.ffn_down.weight" in err
    assert "Q5_1: blk.0.attn_output.weight, blk.1.attn_output.weight" in err
