"""Conformance: every family diffdraft claims (diffdraft.target.families, README "Model families")
gives, on a tiny random model built from transformers' own config class, the same greedy fp32 tokens
with every method as plain decoding and as transformers' ``generate``, through the fast forward
(bit-identical to transformers' forward). A family not claimed is refused for speculation by name,
and plain decoding still runs it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from diffdraft.errors import UnsupportedModelError
from diffdraft.target.families import CLAIMED_MODEL_TYPES
from diffdraft.target.model import TargetModel

from diffdraft_testing.engine import make_method, run_engine
from diffdraft_testing.hugging_face import assert_same_as_hugging_face, assert_windowed_same_as_hugging_face
from diffdraft_testing.targets import hf_greedy, tiny_target, windowed_target

CASES = {
    "llama": ("llama", None),
    "qwen2": ("qwen2", None),
    "qwen2-windowed": ("qwen2", 4),
    "qwen3": ("qwen3", None),
    "gemma2": ("gemma2", 4),
    "gemma3": ("gemma3", 4),
    "mistral": ("mistral", 5),
    "phi3": ("phi3", 5),
}
"""(tiny_target family, its sliding window or None): the README's table, row by row."""
METHODS = ("pld", "chain", "ddtree-8", "ddtree-8+pld")
PROMPT = [3, 9, 4, 1, 7, 7, 2, 5, 8, 3, 9, 4]
NEW_TOKENS = 24


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_claimed_family_decodes_identically_with_every_method(case):
    family, window = CASES[case]
    if window is None:
        target = tiny_target(family, seed=7, dtype=torch.float32)
    else:
        target = windowed_target(family, window, seed=7, dtype=torch.float32)
    assert target.config.model_type in CLAIMED_MODEL_TYPES
    wrapped = TargetModel(target)
    assert wrapped.lean is not None  # the fast forward runs it
    assert wrapped.windows.window == window
    if window is not None:  # against transformers over its own sliding cache
        assert_windowed_same_as_hugging_face(target, layer_ids=[0, 3])
    else:
        assert_same_as_hugging_face(target, layer_ids=[0, 3])
    reference = hf_greedy(target, PROMPT, NEW_TOKENS, None)
    plain, _ = run_engine(
        target, None, make_method("ar", target, [], PROMPT, 5, 7)[1], PROMPT, NEW_TOKENS, 10_000
    )
    assert plain == reference
    for method in METHODS:
        drafter, builder = make_method(method, target, reference, PROMPT, block_size=5, seed=7)
        ours, _ = run_engine(target, drafter, builder, PROMPT, NEW_TOKENS, 10_000)
        assert ours == reference, method


def test_a_family_not_claimed_is_refused_for_speculation_but_decodes_plainly():
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=128)
    gpt2 = AutoModelForCausalLM.from_config(config).float().eval()
    drafter, builder = make_method("pld", gpt2, [], PROMPT, 5, 0)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*Llama \(llama\).*Gemma 3 \(text\)"):
        run_engine(gpt2, drafter, builder, PROMPT, 8, 10_000)
    plain, _ = run_engine(gpt2, None, make_method("ar", gpt2, [], PROMPT, 5, 0)[1], PROMPT, 8, 10_000)
    assert plain == hf_greedy(gpt2, PROMPT, 8, None)
