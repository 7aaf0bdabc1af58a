"""The fused decoder ops: each against a float32 reference on random inputs, and a Q4_1 target's forward
through them batch-invariant (a tree node's outputs are its path's, decoded alone) and lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.packed_linear import pack_linear_layers, packing_supported
from diffdraft.kernels.quantized import decoder_ops as decoder_ops_module
from diffdraft.kernels.quantized.block_linear import BlockQuantizedLinear
from diffdraft.kernels.quantized.decoder_ops import decoder_ops
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target import model as model_module
from diffdraft.target.model import TargetModel, VerifyInput
from diffdraft.trees import ChainBuilder, DDTreeBuilder, DraftTree

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.markers import needs_block_kernel
from diffdraft_testing.quantized import q4_1_target

pytestmark = needs_block_kernel

BF16 = torch.bfloat16
ONE_ULP = 2**-7
"""bfloat16's relative spacing: outputs rounded once from float32 are within half of it."""
TREE = DraftTree(
    tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]),
    parents=torch.tensor([-1, 0, 0, 1, 2, 2, 4]),
    depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
)


def _random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(BF16)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm in float64 up to its bfloat16 rounding of the normalized row."""
    v = x.double()
    unit = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(BF16)
    return weight.double() * unit.double()


@pytest.mark.parametrize("width", [576, 40])
def test_rms_norm_and_the_residual_add_before_it(width):
    ops = decoder_ops()
    x, update, weight = _random(3, width, seed=0), _random(3, width, seed=1), _random(width, seed=2)
    normed = ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed.double(), _rms_norm_reference(x, weight, 1e-5), rtol=ONE_ULP, atol=0)
    total, normed = ops.residual_rms_norm(x, update, weight, 1e-5)
    assert torch.equal(total, x + update)  # Hugging Face's bf16 residual add
    torch.testing.assert_close(
        normed.double(), _rms_norm_reference(total, weight, 1e-5), rtol=ONE_ULP, atol=0
    )


@pytest.mark.parametrize("width", [1536, 24])
def test_silu_gate(width):
    gate_up = _random(4, 2 * width, seed=3, scale=4.0)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = F.silu(gate).to(BF16).double() * up  # SiLU rounds to bf16 before the product, as in HF
    torch.testing.assert_close(decoder_ops().silu_gate(gate_up).double(), expected, rtol=ONE_ULP, atol=0)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 48)])
def test_rotary_split_equals_hugging_face_rotation(heads, kv_heads, dim):
    tokens = 5
    qkv = _random(tokens, (heads + 2 * kv_heads) * dim, seed=4)
    angles = 3 * torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(5))
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    query, key, value = decoder_ops().rotary_split(qkv, cos, sin, heads, kv_heads)
    split = qkv.view(1, tokens, -1, dim).transpose(1, 2)
    expected_query, expected_key = apply_rotary_pos_emb(
        split[:, :heads], split[:, heads : heads + kv_heads], cos[None], sin[None]
    )
    assert torch.equal(query, expected_query[0].transpose(0, 1))
    assert torch.equal(key, expected_key)
    assert torch.equal(value, split[:, heads + kv_heads :])


def test_rotary_split_with_per_head_norms_equals_qwen3s_norm_then_rotation():
    """Qwen3 (and the DFlash drafter) norm each query and key head before rotating it."""
    heads, kv_heads, dim, tokens, eps = 9, 3, 64, 4, 1e-6
    qkv = _random(tokens, (heads + 2 * kv_heads) * dim, seed=6, scale=3.0)
    q_norm, k_norm = _random(dim, seed=7), _random(dim, seed=8)
    angles = 3 * torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(9))
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(BF16) for f in (torch.cos, torch.sin))
    query, key, value = decoder_ops().rotary_split(qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps)
    split = qkv.view(1, tokens, -1, dim).transpose(1, 2)
    normed_query = _rms_norm_reference(split[:, :heads], q_norm, eps).to(BF16)
    normed_key = _rms_norm_reference(split[:, heads : heads + kv_heads], k_norm, eps).to(BF16)
    expected_query, expected_key = apply_rotary_pos_emb(normed_query, normed_key, cos[None], sin[None])
    # the norm may round its last bit the other way; the rotation then rounds its products again
    torch.testing.assert_close(query, expected_query[0].transpose(0, 1), rtol=2 * ONE_ULP, atol=1e-2)
    torch.testing.assert_close(key, expected_key, rtol=2 * ONE_ULP, atol=1e-2)
    assert torch.equal(value, split[:, heads + kv_heads :])
    with pytest.raises(RuntimeError, match="both per-head norms"):
        decoder_ops().rotary_split(qkv, cos, sin, heads, kv_heads, q_norm, None, eps)


def _attention_reference(query, keys, values, mask, scale) -> torch.Tensor:
    """Softmax attention in float64, query head h on K/V head h // group: [tokens, heads * dim]."""
    tokens, heads, dim = query.shape
    group = heads // keys.shape[1]
    k, v = (t[0].double().repeat_interleave(group, dim=0) for t in (keys, values))
    scores = torch.einsum("thd,hld->htl", query.double(), k) * scale
    if mask is not None:
        scores = scores + mask.reshape(tokens, -1).double()
    return torch.einsum("htl,hld->thd", scores.softmax(dim=-1), v).reshape(tokens, heads * dim)


def _cache_views(kv_heads: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a cache holds them: the first ``length`` rows of larger buffers."""
    buffer = _random(2, 1, kv_heads, length + 11, dim, seed=seed)
    return buffer[0, :, :, :length], buffer[1, :, :, :length]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (6, 6, 80), (8, 2, 128)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_attention_under_an_additive_mask(heads, kv_heads, dim, tokens):
    length = 37
    keys, values = _cache_views(kv_heads, length, dim, seed=6)
    query = _random(tokens, heads, dim, seed=7)
    generator = torch.Generator().manual_seed(8)
    visible = torch.rand(tokens, length, generator=generator) > 0.4
    visible[:, -1] = True
    bias = -torch.rand(tokens, length, generator=generator)  # finite biases count, as SDPA adds them
    mask = bias.masked_fill(~visible, torch.finfo(torch.float32).min).to(BF16)[None, None]
    scale = dim**-0.5
    out = decoder_ops().attention(query, keys, values, mask, scale)
    expected = _attention_reference(query, keys, values, mask, scale)
    torch.testing.assert_close(out.double(), expected, rtol=ONE_ULP, atol=1e-5)
    unmasked = decoder_ops().attention(query, keys, values, None, scale)
    expected = _attention_reference(query, keys, values, None, scale)
    torch.testing.assert_close(unmasked.double(), expected, rtol=ONE_ULP, atol=1e-5)


def test_attention_depends_on_the_visible_keys_only():
    """Hidden keys are left out, so a query over a cache with gaps attends exactly as over its visible
    keys alone, and a row of a batch exactly as alone."""
    heads, kv_heads, dim, length = 9, 3, 64, 300
    keys, values = _cache_views(kv_heads, length, dim, seed=9)
    query = _random(4, heads, dim, seed=10)
    visible = torch.rand(4, length, generator=torch.Generator().manual_seed(11)) > 0.5
    visible[:, 0] = True
    for mask in (
        torch.zeros(4, length).masked_fill(~visible, float("-inf")),
        torch.zeros(4, length, dtype=BF16).masked_fill(~visible, torch.finfo(BF16).min),
    ):
        batched = decoder_ops().attention(query, keys, values, mask[None, None], 0.125)
        for t in range(4):
            seen = visible[t].nonzero()[:, 0]
            alone = decoder_ops().attention(
                query[t : t + 1], keys[:, :, seen], values[:, :, seen], None, 0.125
            )
            assert torch.equal(batched[t], alone[0])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 40), (5, 5, 256)])
@pytest.mark.parametrize("mask_dtype", [None, BF16, torch.float16, torch.float32])
def test_query_heads_sharing_a_kv_head_attend_as_each_does_alone(heads, kv_heads, dim, mask_dtype):
    """The op attends a token's query heads of one K/V head together (12 / 2: groups of 6, split in two
    parts); each head's output is, bit for bit, what the op gives that head alone."""
    tokens, length = 9, 41  # a partial last tile of keys
    keys, values = _cache_views(kv_heads, length, dim, seed=14)
    query = _random(tokens, heads, dim, seed=15)
    mask = None
    if mask_dtype is not None:
        visible = torch.rand(tokens, length, generator=torch.Generator().manual_seed(16)) > 0.3
        visible[:, 0] = True
        mask = torch.zeros(tokens, length).masked_fill(~visible, float("-inf")).to(mask_dtype)[None, None]
    together = decoder_ops().attention(query, keys, values, mask, dim**-0.5).view(tokens, heads, dim)
    group = heads // kv_heads
    for head in range(heads):
        kv = slice(head // group, head // group + 1)
        alone = decoder_ops().attention(
            query[:, head : head + 1].contiguous(), keys[:, kv], values[:, kv], mask, dim**-0.5
        )
        assert torch.equal(together[:, head], alone)


def test_attend_cached_appends_each_segments_rows_and_attends_as_attention_over_its_cache():
    """One call for three segments (one token without a mask, a tree of 4 and a chain of 3 under masks,
    over caches of 17, 40 and 0 rows): each buffer gains its segment's keys and values at its start, in
    the layer asked for and nowhere else, and each segment's rows are `attention` over its grown cache."""
    heads, kv_heads, dim, layers, capacity, layer = 9, 3, 64, 3, 48, 1
    counts, starts = [1, 4, 3], [17, 40, 0]
    tokens = sum(counts)
    query = _random(tokens, heads, dim, seed=20)
    key, value = _random(1, kv_heads, tokens, dim, seed=21), _random(1, kv_heads, tokens, dim, seed=22)
    buffers = [_random(layers, 2, 1, kv_heads, capacity, dim, seed=23 + s) for s in range(3)]
    before = [buffer.clone() for buffer in buffers]
    masks = [None]
    for count, start in zip(counts[1:], starts[1:], strict=True):
        visible = torch.ones(count, start + count, dtype=torch.bool)
        visible[:, start:] = torch.ones(count, count, dtype=torch.bool).tril()
        mask = torch.zeros(count, start + count, dtype=BF16).masked_fill(~visible, torch.finfo(BF16).min)
        masks.append(mask[None, None])
    out = decoder_ops().attend_cached(query, key, value, buffers, layer, starts, counts, masks, 0.125)
    first = 0
    for s, (count, start) in enumerate(zip(counts, starts, strict=True)):
        rows = slice(first, first + count)
        written = slice(start, start + count)
        assert torch.equal(buffers[s][layer, 0, 0, :, written], key[0, :, rows])
        assert torch.equal(buffers[s][layer, 1, 0, :, written], value[0, :, rows])
        untouched = buffers[s].clone()
        untouched[layer, :, :, :, written] = before[s][layer, :, :, :, written]
        assert torch.equal(untouched, before[s])
        cache = buffers[s][layer, :, :, :, : start + count]
        expected = decoder_ops().attention(query[rows], cache[0], cache[1], masks[s], 0.125)
        assert torch.equal(out[rows], expected)
        first += count


def _verify_mask(count: int, start: int, window: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A random tree's mask over ``start`` cached keys: each of its ``count`` rows sees its ancestors and
    itself and the context but keys hidden from every row; some rows hide more context keys from a point
    on (where the keys all rows see in the same places end), and with ``window`` > 0 each row hides the
    keys more than ``window`` before its own place (so rows of different depths share none).
    [1, 1, count, start + count], finite biases on the visible keys."""
    generator = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, count)]
    visible = torch.zeros(count, start + count, dtype=torch.bool)
    visible[:, :start] = torch.rand(start, generator=generator) > 0.2
    for j in range(count):
        node, depth = j, 0
        while node >= 0:
            visible[j, start + node] = True
            node, depth = parents[node], depth + 1
        if torch.rand(1, generator=generator) < 0.1:
            cut = int(torch.randint(0, start + 1, (1,), generator=generator))
            visible[j, cut:start] &= torch.rand(start - cut, generator=generator) > 0.1
        if window:
            visible[j, : max(0, start + depth - window)] = False
    hidden = float("-inf") if seed % 2 else torch.finfo(dtype).min
    bias = -0.5 * torch.rand(count, start + count, generator=generator)
    return bias.masked_fill(~visible, hidden).to(dtype)[None, None]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "mask_dtype"),
    [
        (9, 3, 64, 0, BF16),
        (4, 4, 40, 0, torch.float32),
        (8, 4, 80, 0, torch.float16),
        (8, 2, 128, 0, BF16),
        (10, 2, 48, 0, torch.float32),  # groups of 5: parts of 3 and 2
        (6, 3, 64, 20, BF16),
        (4, 1, 16, 9, torch.float32),
    ],
)
def test_the_rows_of_a_segment_attend_as_each_row_alone(heads, kv_heads, dim, window, mask_dtype):
    """attend_cached attends a segment's rows in chunks that share the reading of its keys and values;
    every row's output is, bit for bit, the op's for that row alone, for segments of 1 to 33 rows over
    up to 530 cached keys (the keys all rows see in blocks and a last part), under masks hiding context
    keys (from every row or from some), with sliding windows, alone or beside other segments, on any
    number of threads (which picks the chunks)."""
    counts, starts = [1, 33, 9, 16, 2, 17], [40, 300, 0, 530, 5, 131]
    layer, scale = 1, dim**-0.5
    query = _random(sum(counts), heads, dim, seed=40)
    key, value = (_random(1, kv_heads, len(query), dim, seed=seed) for seed in (41, 42))
    masks = [
        _verify_mask(count, start, window, mask_dtype, seed=43 + s) if count > 1 or s % 2 else None
        for s, (count, start) in enumerate(zip(counts, starts, strict=True))
    ]
    firsts = [sum(counts[:s]) for s in range(len(counts))]
    caches, seen, alone = [], [], []  # per segment the keys and mask columns its rows read
    for s, (count, start, first) in enumerate(zip(counts, starts, firsts, strict=True)):
        buffer = _random(2, 2, 1, kv_heads, start + count, dim, seed=50 + s)
        buffer[layer, 0, 0, :, start:] = key[0, :, first : first + count]
        buffer[layer, 1, 0, :, start:] = value[0, :, first : first + count]
        skipped = max(0, start - window + 1) if window else 0
        caches.append(buffer[layer, :, :, :, skipped:])
        seen.append(None if masks[s] is None else masks[s][..., skipped:])
        for j in range(count):
            row = None if seen[s] is None else seen[s][:, :, j : j + 1]
            alone.append(decoder_ops().attention(query[first + j][None], *caches[s], row, scale))
    alone = torch.cat(alone)
    threads = torch.get_num_threads()
    try:
        for used in (1, 2, 5):
            torch.set_num_threads(used)
            buffers = [
                _random(2, 2, 1, kv_heads, n + start, dim, seed=50 + s)
                for s, (n, start) in enumerate(zip(counts, starts, strict=True))
            ]
            out = decoder_ops().attend_cached(
                query, key, value, buffers, layer, starts, counts, masks, scale, window
            )
            assert torch.equal(out, alone), used
            for s, (n, first) in enumerate(zip(counts, firsts, strict=True)):
                rows = slice(first, first + n)
                assert torch.equal(
                    decoder_ops().attention(query[rows], *caches[s], seen[s], scale), alone[rows]
                )
    finally:
        torch.set_num_threads(threads)


def test_rows_that_see_every_key_attend_as_each_row_alone():
    """A draft block's rows see every key (no mask): the rows share all their keys."""
    keys, values = _cache_views(2, 150, 64, seed=60)
    query = _random(24, 6, 64, seed=61)
    together = decoder_ops().attention(query, keys, values, None, 0.125)
    for t in range(24):
        assert torch.equal(together[t], decoder_ops().attention(query[t][None], keys, values, None, 0.125)[0])


def test_attend_cached_refuses_rows_past_a_buffers_capacity():
    buffer = _random(1, 2, 1, 1, 8, 16, seed=30)
    key = _random(1, 1, 2, 16, seed=31)
    mask = torch.zeros(1, 1, 2, 9, dtype=BF16)
    with pytest.raises(RuntimeError, match="do not fit a buffer of 8"):
        decoder_ops().attend_cached(_random(2, 1, 16, seed=32), key, key, [buffer], 0, [7], [2], [mask], 0.25)


def test_a_mask_that_hides_every_key_is_refused():
    keys, values = _cache_views(1, 5, 16, seed=12)
    mask = torch.full((1, 1, 1, 5), float("-inf"))
    with pytest.raises(RuntimeError, match="hides every key"):
        decoder_ops().attention(_random(1, 2, 16, seed=13), keys, values, mask, 0.25)


def _block_target(family: str, seed: int) -> TargetModel:
    model, _ = q4_1_target(family, seed=seed, vocab=96)
    fuse_projections(model)
    return TargetModel(model)


def test_llama_and_qwen2_block_targets_take_the_fused_path_others_do_not():
    for family in ("llama", "qwen2"):
        assert _block_target(family, seed=0).lean.fused is not None
    assert _block_target("qwen3", seed=0).lean.fused is None  # per-head q/k norms: the eager path
    unstacked, _ = q4_1_target("llama")
    assert TargetModel(unstacked).lean.fused is None
    dense = q4_1_target("llama")[1].to(BF16)
    pack_linear_layers(dense)
    fuse_projections(dense)
    lean = TargetModel(dense).lean
    assert lean.fused is None  # dense: the eager path
    if packing_supported(BF16, torch.device("cpu")):  # its projections stacked all the same
        assert all(s is not None for s in lean.stacked_qkv)


def test_heads_wider_than_the_attention_op_takes_keep_the_eager_path(monkeypatch):
    monkeypatch.setattr(decoder_ops_module, "MAX_HEAD_DIM", 8)  # the tiny target's heads are 16 wide
    assert _block_target("llama", seed=0).lean.fused is None


def _tree_logits(target: TargetModel, prompt: torch.Tensor) -> torch.Tensor:
    cache = target.new_cache()
    target.prefill(cache, prompt, [])
    mask = target.attention_mask(cache, TREE.ancestor_mask())
    return target.verify(cache, TREE.tokens, TREE.position_ids(len(prompt)), mask, []).logits.double()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_as_close_to_the_float32_model_as_the_eager_layers(family):
    for seed in range(2):
        model, dense = q4_1_target(family, seed=seed, vocab=96)
        fuse_projections(model)
        target = TargetModel(model)
        prompt = torch.randint(1, 95, (13,), generator=torch.Generator().manual_seed(seed))
        exact = _tree_logits(TargetModel(dense), prompt)
        fused_error = (_tree_logits(target, prompt) - exact).abs().max()
        target.lean.fused = None
        eager_error = (_tree_logits(target, prompt) - exact).abs().max()
        assert fused_error < 1.5 * eager_error


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_nodes_get_the_outputs_of_their_path_decoded_token_by_token(family):
    target = _block_target(family, seed=1)
    prompt = torch.randint(1, 95, (13,), generator=torch.Generator().manual_seed(1))
    start, layer_ids = len(prompt), [0, 2, 3]
    cache = target.new_cache()
    target.prefill(cache, prompt, [])
    mask = target.attention_mask(cache, TREE.ancestor_mask())
    tree = target.verify(cache, TREE.tokens, TREE.position_ids(start), mask, layer_ids)
    for path in ([0, 1, 3], [0, 2, 4, 6], [0, 2, 5]):
        cache = target.new_cache()
        target.prefill(cache, prompt, [])
        for depth, node in enumerate(path):
            alone = target.verify(
                cache, TREE.tokens[node : node + 1], torch.tensor([start + depth]), None, layer_ids
            )
            assert torch.equal(alone.hidden[0], tree.hidden[node])
            assert torch.equal(alone.logits[0], tree.logits[node])


def test_taps_in_any_order_are_the_fused_loops_columns():
    """The fused loop stacks the taps of ascending layers below the last; the final norm's rows stand
    for the last layer, and ids in another order or given twice pick those columns."""
    target = _block_target("llama", seed=4)
    prompt = torch.randint(1, 95, (9,), generator=torch.Generator().manual_seed(4))
    outputs = []
    for layer_ids in ([0, 2, 3], [3, 0, 2, 0], [3]):
        cache = target.new_cache()
        target.prefill(cache, prompt, [])
        mask = target.attention_mask(cache, TREE.ancestor_mask())
        outputs.append(
            target.verify(cache, TREE.tokens, TREE.position_ids(len(prompt)), mask, layer_ids).hidden
        )
    ascending, shuffled, last = outputs
    assert torch.equal(shuffled, ascending[:, [2, 0, 1, 0]])
    assert torch.equal(last, ascending[:, 2:])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prefill_in_chunks_gives_each_prompt_token_what_its_decode_step_would(family, monkeypatch):
    """A prefill through the fused ops is the prompt decoded token by token, chunk boundaries aside:
    the last token's logits, every token's taps and the cache it leaves."""
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 5)  # 13 tokens: chunks of 5, 5 and 3
    target = _block_target(family, seed=3)
    prompt = torch.randint(1, 95, (13,), generator=torch.Generator().manual_seed(3))
    layer_ids = [0, 2, 3]
    cache = target.new_cache()
    prefilled = target.prefill(cache, prompt, layer_ids)
    stepped, taps = target.new_cache(), []
    for position, token in enumerate(prompt):
        step = target.verify(stepped, token[None], torch.tensor([position]), None, layer_ids)
        taps.append(step.hidden)
    assert prefilled.logits.shape[0] == 1 and torch.equal(prefilled.logits[0], step.logits[0])
    assert torch.equal(prefilled.hidden, torch.cat(taps))
    for a, b in zip(cache.layers, stepped.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_packed_sequences_get_their_own_forwards_outputs():
    target = _block_target("llama", seed=2)
    prompts = [torch.randint(1, 95, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 11)]
    inputs, alone = [], []
    for prompt in prompts:
        for outputs in (inputs, alone):
            cache = target.new_cache()
            target.prefill(cache, prompt, [])
            mask = target.attention_mask(cache, TREE.ancestor_mask())
            outputs.append(VerifyInput(cache, TREE.tokens, TREE.position_ids(len(prompt)), mask))
    packed = target.verify_batch(inputs, [1, 3])
    for one, together in zip(alone, packed, strict=True):
        expected = target.verify(one.cache, one.token_ids, one.position_ids, one.mask, [1, 3])
        assert torch.equal(together.logits, expected.logits) and torch.equal(together.hidden, expected.hidden)
    for one, together in zip(alone, inputs, strict=True):
        for a, b in zip(one.cache.layers, together.cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q|k|v projections
def test_the_layer_loop_in_one_op_gives_the_python_loops_bits(family):
    """``decode_layers`` against :class:`FusedDecoderLayers`' Python loop over the same ops: packed
    trees of two sequences with taps, their logits, taps and the rows each leaves in its cache."""
    target = _block_target(family, seed=4)
    assert target.lean.fused.stack is not None
    prompts = [torch.randint(1, 95, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    results, caches = {}, {}
    for looped in (True, False):
        stack = target.lean.fused.stack
        if not looped:
            target.lean.fused.stack = None
        inputs = []
        for prompt in prompts:
            cache = target.new_cache()
            target.prefill(cache, prompt, [])
            target.verify(cache, prompt[-1:], torch.tensor([len(prompt)]), None, [])  # the buffer started
            mask = target.attention_mask(cache, TREE.ancestor_mask())
            inputs.append(VerifyInput(cache, TREE.tokens, TREE.position_ids(len(prompt) + 1), mask))
        results[looped] = target.verify_batch(inputs, [0, 2, 3])
        caches[looped] = [one.cache for one in inputs]
        target.lean.fused.stack = stack
    for looped, python in zip(results[True], results[False], strict=True):
        assert torch.equal(looped.logits, python.logits) and torch.equal(looped.hidden, python.hidden)
    for looped, python in zip(caches[True], caches[False], strict=True):
        for a, b in zip(looped.layers, python.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_layers_on_the_bf16_kernel_keep_the_python_loop():
    model, _ = q4_1_target("llama", seed=0, vocab=96)
    for name, module in list(model.model.layers.named_modules()):
        if isinstance(module, BlockQuantizedLinear):
            parent_name, _, attribute = name.rpartition(".")
            parent = model.model.layers.get_submodule(parent_name)
            setattr(parent, attribute, BlockQuantizedLinear(module.blocks, module.bias, "bf16"))
    fuse_projections(model)
    fused = TargetModel(model).lean.fused
    assert fused is not None and fused.stack is None


def _generate(target: TargetModel, drafter, builder, prompt: list[int]) -> list[int]:
    config = target.model.config
    stop = StopConditions([config.eos_token_id], 24, config.max_position_embeddings, len(prompt))
    engine = SpeculativeEngine(target, drafter, builder)
    return [t for chunk in engine.run(SequenceSpec(prompt, stop)) for t in chunk]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("builder", [ChainBuilder(), DDTreeBuilder(12)], ids=["chain", "ddtree"])
def test_speculative_greedy_tokens_are_plain_decodings_exactly(family, builder):
    for seed in range(3):
        target = _block_target(family, seed=seed)
        prompt = torch.randint(1, 95, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        drafter = DFlashDrafter(tiny_drafter(target.model, seed, block_size=5), target)
        assert _generate(target, drafter, builder, prompt) == _generate(target, None, ChainBuilder(), prompt)
