"""The fused decoder layers on a Gemma 3 target: Gemma's ops against float64 references, and a tiny random
Gemma 3 on Q4_1 blocks (sliding-window layers of 4 keys among full ones, prompts longer than the window)
through :class:`FusedDecoderLayers` as close to the float32 model as Hugging Face's own forward on the same
blocks, batch-invariant (a tree node's outputs are its path's, decoded alone), the same bits from the
Python loop and from ``decode_gemma_layers``, and its windowed layers attending only inside the window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

from diffdraft.kernels.attention_window import FULL, SLIDING
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.lean_forward import segment_rows
from diffdraft.kernels.quantized.decoder_ops import FusedDecoderLayers, decoder_ops, gemma_norm_weights
from diffdraft.kernels.segment import Segment
from diffdraft.target.model import TargetModel
from diffdraft.trees import DraftTree

from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target

pytestmark = needs_block_kernel

BF16 = torch.bfloat16
ONE_ULP = 2**-7
"""bfloat16's relative spacing: outputs rounded once from float32 are within half of it."""
WINDOW = 4
LAYER_TYPES = [SLIDING, FULL, SLIDING, SLIDING]
TREE = DraftTree(
    tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
    parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
)
PATHS = ([0, 1, 3], [0, 2, 4, 6], [0, 2, 5])


def _random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(BF16)


def _gemma_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in float64 up to its one rounding to bfloat16."""
    v = x.double()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.double())


@pytest.mark.parametrize("width", [640, 40])
def test_gemma_norms_and_the_normed_residual_add(width):
    """A float32 weight (Gemma's 1 + weight) makes the norm Gemma's: one rounding of the float32 row times
    1 + weight; the residual step norms the update, adds it to the stream rounded, and norms the sum."""
    ops = decoder_ops()
    x, update = _random(3, width, seed=0), _random(3, width, seed=1, scale=30.0)
    weight, update_weight = _random(width, seed=2), _random(width, seed=3)
    one_plus, eps = (1 + weight.float()).contiguous(), 1e-6
    normed = ops.rms_norm(x, one_plus, eps)
    torch.testing.assert_close(normed.double(), _gemma_norm_reference(x, weight, eps), rtol=ONE_ULP, atol=0)
    total, normed = ops.normed_residual_rms_norm(x, update, (1 + update_weight.float()), 1e-5, one_plus, eps)
    normed_update = ops.rms_norm(update, (1 + update_weight.float()), 1e-5)
    torch.testing.assert_close(
        normed_update.double(), _gemma_norm_reference(update, update_weight, 1e-5), rtol=ONE_ULP, atol=0
    )
    assert torch.equal(total, x + normed_update)  # Hugging Face's bf16 residual add of the normed update
    torch.testing.assert_close(
        normed.double(), _gemma_norm_reference(total, weight, eps), rtol=ONE_ULP, atol=0
    )
    llama = ops.rms_norm(x, weight, eps)  # a bfloat16 weight keeps the Llama norm
    assert not torch.equal(llama, ops.rms_norm(x, weight.float(), eps))


@pytest.mark.parametrize("width", [2048, 24])
def test_gelu_tanh_gate(width):
    gate_up = _random(4, 2 * width, seed=4, scale=4.0)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh").to(BF16).double() * up  # rounded first, as in HF
    got = decoder_ops().gelu_tanh_gate(gate_up).double()
    # atol: far down the negative tail float32's tanh gives 1 + tanh(u) = 0, the sigmoid form ~1e-15
    torch.testing.assert_close(got, expected, rtol=ONE_ULP, atol=1e-6)


def test_rotary_split_with_gemma_head_norms_equals_hugging_faces_norm_then_rotation():
    """Gemma 3's q_norm / k_norm (float32 1 + weight) and its rotary, each head on its own."""
    heads, kv_heads, dim, tokens, eps = 4, 1, 256, 5, 1e-6
    qkv = _random(tokens, (heads + 2 * kv_heads) * dim, seed=5, scale=3.0)
    q_weight, k_weight = _random(dim, seed=6), _random(dim, seed=7)
    angles = 3 * torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(8))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    query, key, value = decoder_ops().rotary_split(
        qkv, cos, sin, heads, kv_heads, (1 + q_weight.float()), (1 + k_weight.float()), eps
    )
    heads_of = qkv.view(tokens, heads + 2 * kv_heads, dim).transpose(0, 1)[None]
    q = _gemma_norm_reference(heads_of[:, :heads], q_weight, eps).to(BF16)
    k = _gemma_norm_reference(heads_of[:, heads : heads + kv_heads], k_weight, eps).to(BF16)
    q, k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    torch.testing.assert_close(query.transpose(0, 1)[None].double(), q.double(), rtol=2 * ONE_ULP, atol=1e-2)
    torch.testing.assert_close(key.double(), k.double(), rtol=2 * ONE_ULP, atol=1e-2)
    assert torch.equal(value[0], heads_of[0, heads + kv_heads :])


def test_attend_cached_with_a_window_reads_only_the_rows_the_window_shows():
    """A windowed layer's lone token (no mask) attends exactly over the last ``window`` rows, and a chain
    under a mask that applies the window exactly as the full layer under that mask."""
    heads, kv_heads, dim, capacity, window = 4, 1, 256, 64, 5
    start, tokens = 20, 3
    buffer = _random(1, 2, 1, kv_heads, capacity, dim, seed=9)
    query = _random(tokens, heads, dim, seed=10)
    key, value = _random(1, kv_heads, tokens, dim, seed=11), _random(1, kv_heads, tokens, dim, seed=12)
    ops = decoder_ops()
    lone = ops.attend_cached(
        query[:1], key[:, :, :1], value[:, :, :1], [buffer], 0, [start], [1], [None], 0.1, window
    )
    rows = buffer[0, :, :, :, start + 1 - window : start + 1]
    assert torch.equal(lone, ops.attention(query[:1], rows[0], rows[1], None, 0.1))
    whole = ops.attend_cached(
        query[:1], key[:, :, :1], value[:, :, :1], [buffer], 0, [start], [1], [None], 0.1
    )
    assert not torch.equal(lone, whole)  # the rows before the window count without it
    positions = torch.arange(start + tokens)
    behind = positions[start:, None] - positions[None, :] >= window
    causal = positions[None, :] > positions[start:, None]
    mask = torch.zeros(tokens, start + tokens, dtype=BF16).masked_fill(behind | causal, torch.finfo(BF16).min)
    chain = ops.attend_cached(
        query, key, value, [buffer], 0, [start], [tokens], [mask[None, None]], 0.1, window
    )
    full = ops.attend_cached(query, key, value, [buffer], 0, [start], [tokens], [mask[None, None]], 0.1)
    assert torch.equal(chain, full)
    with pytest.raises(RuntimeError, match="needs a mask"):
        ops.attend_cached(query, key, value, [buffer], 0, [start], [tokens], [None], 0.1, window)


def _gemma_target(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, FusedDecoderLayers]:
    """A tiny Gemma 3 on Q4_1 blocks with random norm weights (Gemma's start at 0: 1 + 0 hides a misread
    weight), its float32 dense twin, and its fused layers."""
    model, dense = q4_1_target(
        "gemma3", seed=seed, vocab=96, sliding_window=WINDOW, layer_types=LAYER_TYPES, max_positions=64
    )
    generator = torch.Generator().manual_seed(seed)
    for module, twin in zip(model.modules(), dense.modules(), strict=True):
        if type(module).__name__ == "Gemma3RMSNorm":
            weight = (0.5 * torch.randn(module.weight.shape, generator=generator)).to(BF16)
            module.weight.data, twin.weight.data = weight, weight.float()
    fuse_projections(model)
    layers = list(model.model.layers)
    fused = FusedDecoderLayers.build(model, layers, [None] * len(layers))
    assert fused is not None and fused.gemma and fused.stack is not None
    return model, dense, fused


def _forward(model, fused, segments, tokens, positions, tapped=()):
    """The lean forward's part around the fused layers: embeddings (scaled), each layer type's rotary
    table from the model's own rotary module, the LM head. Returns (logits, taps) over all segments' rows."""
    hidden = model.model.embed_tokens(tokens[None])
    rotary = {kind: model.model.rotary_emb(hidden, positions[None], kind) for kind in fused.kinds}
    normed, taps = fused(hidden[0], rotary, segments, segment_rows(segments), list(tapped))
    return model.lm_head(normed[None])[0], taps


def _decoded(model, fused, target, prompt, prefill: int, tapped=()):
    """``prompt``'s logits and taps: its first ``prefill`` tokens in one forward under a causal mask (the
    cache's first: Python attention over the cache's own update), then one token at a time without a mask
    (the shared buffer: the C++ loop)."""
    cache = target.new_cache()
    mask = target.attention_mask(cache, torch.ones(prefill, prefill, dtype=torch.bool).tril())
    logits, taps = _forward(
        model, fused, [Segment(cache, prefill, mask)], prompt[:prefill], torch.arange(prefill), tapped
    )
    outputs = [(logits, taps)]
    for position in range(prefill, len(prompt)):
        step = Segment(cache, 1, None)
        outputs.append(
            _forward(model, fused, [step], prompt[position : position + 1], torch.tensor([position]), tapped)
        )
    logits = torch.cat([o[0] for o in outputs])
    return logits, (torch.cat([o[1] for o in outputs]) if tapped else None), cache


@torch.inference_mode()
@pytest.mark.parametrize("seed", [0, 1])
def test_as_close_to_the_float32_model_as_hugging_faces_forward_on_the_blocks(seed):
    """A prompt three windows long: a prefill of 5, then decode steps, every position's logits against the
    float32 dense model's, with Hugging Face's bf16 forward over the same block linears as the yardstick."""
    model, dense, fused = _gemma_target(seed)
    target = TargetModel(model)
    prompt = torch.randint(1, 95, (13,), generator=torch.Generator().manual_seed(seed))
    ours, _, _ = _decoded(model, fused, target, prompt, prefill=5)
    exact = dense(prompt[None]).logits[0].double()
    hf = model(prompt[None]).logits[0].double()
    fused_error, hf_error = (ours.double() - exact).abs().max(), (hf - exact).abs().max()
    assert fused_error < 1.5 * hf_error
    torch.testing.assert_close(ours.double(), hf, rtol=0, atol=0.05 * exact.abs().max().item())


@torch.inference_mode()
def test_the_windowed_layers_see_only_their_window():
    """Ignoring the window (every layer attending over the whole cache) moves the decode steps' logits
    several times further from the float32 model's than the fused layers are."""
    model, dense, fused = _gemma_target(0)
    target = TargetModel(model)
    prompt = torch.randint(1, 95, (13,), generator=torch.Generator().manual_seed(0))
    exact = dense(prompt[None]).logits[0].double()
    ours, _, _ = _decoded(model, fused, target, prompt, prefill=5)
    for layer in fused.layers:
        layer.window = 0
    fused.windows = [0] * len(fused.layers)
    unwindowed, _, _ = _decoded(model, fused, target, prompt, prefill=5)
    assert torch.equal(ours[:5], unwindowed[:5])  # the prefill's mask still applies the window
    error = (ours[5:].double() - exact[5:]).abs().max()
    assert (unwindowed[5:].double() - exact[5:]).abs().max() > 3 * error


def _tree_outputs(model, fused, target, prompt, layer_ids):
    """The tree's (logits, taps) after ``prompt``, and the cache it leaves."""
    _, _, cache = _decoded(model, fused, target, prompt, prefill=len(prompt) - 1)
    mask = target.attention_mask(cache, TREE.ancestor_mask())
    segment = Segment(cache, len(TREE.tokens), mask)
    return _forward(model, fused, [segment], TREE.tokens, TREE.position_ids(len(prompt)), layer_ids), cache


@torch.inference_mode()
@pytest.mark.parametrize("python_loop", [False, True])
def test_tree_nodes_get_the_outputs_of_their_path_decoded_token_by_token(python_loop):
    """A tree three nodes deep after a prompt of 11 (window 4): each node's logits and taps are, bit for
    bit, those of its path's tokens decoded one at a time, through either loop."""
    model, _, fused = _gemma_target(1)
    if python_loop:
        fused.stack = None
    target = TargetModel(model)
    prompt = torch.randint(1, 95, (11,), generator=torch.Generator().manual_seed(1))
    layer_ids = [0, 2]
    (tree_logits, tree_taps), _ = _tree_outputs(model, fused, target, prompt, layer_ids)
    for path in PATHS:
        _, _, cache = _decoded(model, fused, target, prompt, prefill=len(prompt) - 1)
        for depth, node in enumerate(path):
            token = TREE.tokens[node : node + 1]
            logits, taps = _forward(
                model, fused, [Segment(cache, 1, None)], token, torch.tensor([len(prompt) + depth]), layer_ids
            )
            assert torch.equal(logits[0], tree_logits[node]) and torch.equal(taps[0], tree_taps[node])


@torch.inference_mode()
def test_packed_sequences_and_both_loops_give_the_same_bits():
    """Two sequences' trees in one forward: each sequence's logits, taps and cache rows are those of its
    forward alone, and ``decode_gemma_layers`` gives the Python loop's bits."""
    model, _, fused = _gemma_target(2)
    target = TargetModel(model)
    prompts = [torch.randint(1, 95, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 11)]
    layer_ids = [1, 2]
    stack = fused.stack
    results = {}
    for looped in (True, False):
        fused.stack = stack if looped else None
        segments, tokens, positions, alone = [], [], [], []
        for prompt in prompts:
            (logits, taps), cache = _tree_outputs(model, fused, target, prompt, layer_ids)
            alone.append((logits, taps, cache))
            _, _, cache = _decoded(model, fused, target, prompt, prefill=len(prompt) - 1)
            segments.append(
                Segment(cache, len(TREE.tokens), target.attention_mask(cache, TREE.ancestor_mask()))
            )
            tokens.append(TREE.tokens)
            positions.append(TREE.position_ids(len(prompt)))
        logits, taps = _forward(model, fused, segments, torch.cat(tokens), torch.cat(positions), layer_ids)
        n = len(TREE.tokens)
        for s, (one_logits, one_taps, one_cache) in enumerate(alone):
            assert torch.equal(logits[s * n : (s + 1) * n], one_logits)
            assert torch.equal(taps[s * n : (s + 1) * n], one_taps)
            for a, b in zip(segments[s].cache.layers, one_cache.layers, strict=True):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        results[looped] = (logits, taps, [segment.cache for segment in segments])
    (c_logits, c_taps, c_caches), (p_logits, p_taps, p_caches) = results[True], results[False]
    assert torch.equal(c_logits, p_logits) and torch.equal(c_taps, p_taps)
    for c_cache, p_cache in zip(c_caches, p_caches, strict=True):
        for a, b in zip(c_cache.layers, p_cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_gemma_norm_weights_are_one_plus_the_weight_in_float32():
    model, _, fused = _gemma_target(0)
    norm = model.model.layers[0].input_layernorm
    weight, eps = gemma_norm_weights(norm)
    assert (
        weight.dtype == torch.float32 and torch.equal(weight, 1.0 + norm.weight.float()) and eps == norm.eps
    )
    assert fused.kinds == sorted({FULL, SLIDING}) and fused.windows == [WINDOW, 0, WINDOW, WINDOW]


def test_gemma_targets_off_the_fused_path():
    """Dense layers, unstacked projections and attention soft-capping keep Hugging Face's forward."""
    model, _ = q4_1_target("gemma3", seed=0, vocab=96, sliding_window=WINDOW, layer_types=LAYER_TYPES)
    layers = list(model.model.layers)
    assert FusedDecoderLayers.build(model, layers, [None] * len(layers)) is None  # not stacked
    fuse_projections(model)
    model.config.attn_logit_softcapping = 50.0
    assert FusedDecoderLayers.build(model, layers, [None] * len(layers)) is None
    model.config.attn_logit_softcapping = None
    assert FusedDecoderLayers.build(model, layers, [None] * len(layers)) is not None
