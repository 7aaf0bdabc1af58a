"""DFlash / DFlare drafter: official checkpoint layout, parity with the reference package, caching."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch
from transformers import Qwen2Config

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFLARE, DFLASH, default_target_layer_ids, make_draft_config
from diffdraft.errors import CheckpointError, IncompatibleDrafterError
from diffdraft.target.model import TargetModel

from diffdraft_testing.drafters import DFLASH_LAYER_WEIGHTS, forks_with_contexts, tiny_drafter
from diffdraft_testing.targets import tiny_target


def official_keys(layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    return keys | {f"layers.{i}.{k}" for i in range(layers) for k in DFLASH_LAYER_WEIGHTS}


def test_dflash_checkpoint_has_the_official_layout_and_round_trips(tmp_path):
    target = tiny_target("qwen3")
    model = tiny_drafter(target, layers=2, block_size=5)
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 5
    assert config["num_target_layers"] == 4
    assert config["dflash_config"]["mask_token_id"] == 62
    assert config["dflash_config"]["target_layer_ids"] == [0, 3]
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "model.safetensors")) == official_keys(2)
    loaded = load_draft_model(tmp_path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_dflare_round_trip_keeps_the_dflash_layout_plus_its_own_weights(tmp_path):
    target = tiny_target("llama")
    model = tiny_drafter(target, layers=3, variant=DFLARE, target_layer_ids=[0, 1, 2, 3])
    with torch.no_grad():
        model.fusion.weight.normal_()
    save_draft_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dflash_config"]["variant"] == DFLARE
    assert config["architectures"] == ["DFlareDraftModel"]
    loaded = load_draft_model(tmp_path)
    assert loaded.variant == DFLARE
    keys = set(loaded.state_dict())
    assert "fc.weight" not in keys and "hidden_norm.weight" not in keys
    assert keys >= {
        "fusion.weight",
        "layers.2.self_attn.context_k_proj.weight",
        "layers.0.context_norm.weight",
    }
    assert keys >= official_keys(3) - {"fc.weight", "hidden_norm.weight"}
    torch.testing.assert_close(loaded.fusion.weight, model.fusion.weight)


def test_settings_are_read_from_top_level_or_dflash_config(tmp_path):
    target = tiny_target("qwen3")
    save_draft_model(tiny_drafter(target, block_size=6), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mask_token_id"] = config["dflash_config"].pop("mask_token_id")
    config["dflash_config"]["block_size"] = config.pop("block_size")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_draft_model(tmp_path)
    assert (loaded.block_size, loaded.mask_token_id) == (6, 62)


def test_matches_the_official_dflash_package_in_both_directions(tmp_path):
    # skipped only where dflash is not installed (scripts/install.sh installs it, so CI checks this);
    # installed but failing to import, say against a newer transformers, fails here instead
    if importlib.util.find_spec("dflash") is None:
        pytest.skip("dflash==0.1.0 is not installed (scripts/install.sh installs it)")
    official = importlib.import_module("dflash")
    target = tiny_target("qwen3", dtype=torch.float32)
    ours = tiny_drafter(target, layers=2, block_size=4, target_layer_ids=[1, 2]).float()
    save_draft_model(ours, tmp_path / "ours")
    reference = official.DFlashDraftModel.from_pretrained(tmp_path / "ours").eval()

    torch.manual_seed(0)
    taps = torch.randn(1, 9, 2, target.config.hidden_size)
    block = torch.randn(1, 4, target.config.hidden_size)
    expected = reference(
        target_hidden=taps.flatten(-2), noise_embedding=block, position_ids=torch.arange(13)[None]
    )
    got = ours(block, torch.arange(9, 13)[None], ours.context_kv(taps, torch.arange(9)[None]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    reference.save_pretrained(tmp_path / "official")
    loaded = load_draft_model(tmp_path / "official")
    got = loaded(block, torch.arange(9, 13)[None], loaded.context_kv(taps, torch.arange(9)[None]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
def test_incremental_context_cache_equals_full_recompute(variant):
    target = tiny_target("qwen2")
    wrapped = TargetModel(target)
    model = tiny_drafter(target, layers=2, block_size=5, variant=variant)
    drafter = DFlashDrafter(model, wrapped)
    taps = torch.randn(12, 2, target.config.hidden_size, dtype=target.dtype)
    tokens = torch.randint(0, 60, (13,))
    drafter.reset()
    for begin, end in [(0, 5), (5, 6), (6, 12)]:
        drafter.extend_context(taps[begin:end], begin)
    incremental = drafter.propose(tokens, 4).log_probs

    full_kv = model.context_kv(taps[None], torch.arange(12)[None])
    block = torch.tensor([int(tokens[-1])] + [model.mask_token_id] * 4)
    hidden = model(target.get_input_embeddings()(block[None]), torch.arange(12, 17)[None], full_kv)
    expected = target.get_output_embeddings()(hidden[0, 1:]).float().log_softmax(-1)
    torch.testing.assert_close(incremental, expected)


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
def test_a_context_with_gaps_drafts_from_the_rows_it_has_at_their_positions(variant):
    """Rounds verified without taps (None) leave gaps: the block attends to the rows there are, each
    projected at its own position."""
    target = tiny_target("qwen2")
    model = tiny_drafter(target, layers=2, block_size=5, variant=variant)
    drafter = DFlashDrafter(model, TargetModel(target))
    assert drafter.tolerates_gaps()
    taps = torch.randn(12, 2, target.config.hidden_size, dtype=target.dtype)
    tokens = torch.randint(0, 60, (13,))
    for begin, end, tapped in [(0, 5, True), (5, 6, False), (6, 8, False), (8, 12, True)]:
        drafter.extend_context(taps[begin:end] if tapped else None, begin)
    gapped = drafter.propose(tokens, 4).log_probs

    kept = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11])
    context_kv = model.context_kv(taps[kept][None], kept[None])
    block = torch.tensor([int(tokens[-1])] + [model.mask_token_id] * 4)
    hidden = model(target.get_input_embeddings()(block[None]), torch.arange(12, 17)[None], context_kv)
    expected = target.get_output_embeddings()(hidden[0, 1:]).float().log_softmax(-1)
    torch.testing.assert_close(gapped, expected)


def test_default_layer_ids_spread_from_shallow_to_deep():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]


def test_default_layer_ids_are_distinct_target_layers_however_shallow_the_target():
    for layers in range(1, 40):
        ids = default_target_layer_ids(layers, 5)
        assert len(ids) == min(5, max(1, layers - 3)) and ids == sorted(set(ids)), (layers, ids)
        assert ids[0] >= 0 and ids[-1] < layers, (layers, ids)


QWEN25_05B = Qwen2Config(  # Qwen2.5-0.5B's shape: 24 layers
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_a_new_drafter_taps_layers_spread_over_the_target_whatever_its_own_depth(depth):
    config = make_draft_config(QWEN25_05B, num_layers=depth, block_size=16, mask_token_id=151665)
    assert config.num_hidden_layers == depth
    assert config.dflash_config["target_layer_ids"] == [1, 6, 11, 16, 21]
    dflare = make_draft_config(
        QWEN25_05B, num_layers=depth, block_size=16, mask_token_id=151665, variant=DFLARE
    )
    assert dflare.dflash_config["target_layer_ids"] == [1, 4, 6, 8, 11, 14, 16, 18, 21]


def test_the_shipped_drafter_keeps_the_taps_a_new_dflare_gets_on_its_target():
    shipped = load_draft_model("default")
    smollm2 = Qwen2Config(num_hidden_layers=shipped.config.num_target_layers)  # only the depth counts
    config = make_draft_config(smollm2, num_layers=2, block_size=8, mask_token_id=16, variant=DFLARE)
    assert (
        config.dflash_config["target_layer_ids"]
        == shipped.target_layer_ids
        == [1, 4, 8, 11, 14, 17, 20, 24, 27]
    )


def test_mismatched_drafter_and_target_are_rejected_with_the_reason():
    target = tiny_target("llama", hidden=32)
    other = tiny_target("llama", hidden=48)
    with pytest.raises(IncompatibleDrafterError, match="hidden size 48 != target hidden size 32"):
        DFlashDrafter(tiny_drafter(other), TargetModel(target))
    bigger_vocab = tiny_target("llama", vocab=128)
    with pytest.raises(IncompatibleDrafterError, match="vocab size 128 != target vocab size 64"):
        DFlashDrafter(tiny_drafter(bigger_vocab), TargetModel(target))
    deeper = tiny_target("llama", layers=8)
    with pytest.raises(IncompatibleDrafterError, match="8 layers"):
        DFlashDrafter(tiny_drafter(deeper, target_layer_ids=[1, 6]), TargetModel(target))


def test_missing_and_corrupt_checkpoints_raise_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_draft_model(tmp_path / "empty")

    save_draft_model(tiny_drafter(tiny_target()), tmp_path / "ok")
    weights = tmp_path / "ok" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_draft_model(tmp_path / "ok")
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"missing its weights file model\.safetensors"):
        load_draft_model(tmp_path / "ok")

    save_draft_model(tiny_drafter(tiny_target(), layers=2), tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not a consistent drafter config"):
        load_draft_model(tmp_path / "two")
    del config["layer_types"]
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_draft_model(tmp_path / "two")


def test_draft_vocabulary_scores_only_its_tokens_and_survives_a_bf16_round_trip(tmp_path):
    target = tiny_target("llama")
    wrapped = TargetModel(target)
    vocab = [3, 5, 8, 13, 21, 34, 55]
    model = tiny_drafter(target, layers=2, block_size=4, draft_vocab=vocab)
    save_draft_model(model, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == 7
    loaded = load_draft_model(tmp_path)
    assert loaded.draft_vocab.dtype == torch.long and loaded.draft_vocab.tolist() == vocab

    drafter = DFlashDrafter(model, wrapped)
    taps = torch.randn(6, 2, target.config.hidden_size, dtype=target.dtype)
    drafter.extend_context(taps, 0)
    tokens = torch.randint(0, 60, (7,))
    restricted = drafter.propose(tokens, 3).log_probs
    outside = torch.ones(restricted.shape[1], dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(restricted[:, outside]).all()
    # inside the vocabulary: the full-head distribution renormalized over those tokens
    unrestricted = DFlashDrafter(tiny_drafter(target, layers=2, block_size=4), wrapped)
    unrestricted.extend_context(taps, 0)
    full = unrestricted.propose(tokens, 3).log_probs
    torch.testing.assert_close(restricted[:, vocab], full[:, vocab].log_softmax(-1))


def test_a_draft_vocabulary_beyond_the_target_vocabulary_is_rejected():
    target = tiny_target("llama", vocab=64)
    model = tiny_drafter(target, draft_vocab=[1, 2])
    model.draft_vocab[1] = 100  # as if it had been chosen for a bigger tokenizer
    with pytest.raises(IncompatibleDrafterError, match="draft_vocab holds token ids outside"):
        DFlashDrafter(model, TargetModel(target))


@pytest.mark.parametrize("variant", [DFLASH, DFLARE])
@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 64, 2))])
def test_one_forward_drafts_every_fork_as_each_drafts_alone(variant, draft_vocab):
    from diffdraft.drafters.base import propose_together
    from diffdraft.runtime.sampling import SamplingParams
    from diffdraft.trees import DDTreeBuilder, TreeRound

    target = tiny_target("qwen3", seed=3)
    drafter = DFlashDrafter(
        tiny_drafter(target, layers=2, block_size=6, variant=variant, draft_vocab=draft_vocab),
        TargetModel(target),
    )
    forks, token_ids = forks_with_contexts(drafter, [7, 2, 12, 5], 3, target.config.hidden_size)
    depths = [5, 3, 1, 5]  # sequences near their end draft shorter blocks
    together = propose_together(forks, token_ids, depths)
    for fork, ids, depth, proposal in zip(forks, token_ids, depths, together, strict=True):
        alone = fork.propose(ids, depth)
        assert proposal.log_probs.shape == alone.log_probs.shape == (depth, target.config.vocab_size)
        torch.testing.assert_close(proposal.log_probs, alone.log_probs, rtol=0, atol=1e-12)
        trees = [
            DDTreeBuilder(12).build(TreeRound(int(ids[-1]), p, SamplingParams(), None))
            for p in (proposal, alone)
        ]
        assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(
            trees[0].parents, trees[1].parents
        )
    assert [f._context.length for f in forks] == [7, 2, 12, 5]  # untouched
