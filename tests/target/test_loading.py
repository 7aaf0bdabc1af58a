"""Loading targets from local directories and GGUF files, dtype rules, the error messages, end tokens."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.errors import CheckpointError, InvalidRequestError
from diffdraft.generator import SpeculativeGenerator
from diffdraft.kernels.fused_projections import ProjectionSlice
from diffdraft.kernels.grouped_attention import NAME
from diffdraft.kernels.packed_linear import has_packed_layers, packing_supported
from diffdraft.kernels.quantized.kernel_build import cpu_supported
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.loading import LoadedModel, end_token_ids, fastest_dtype, load_target, native_bfloat16
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder

from diffdraft_testing.checkpoints import CHECKPOINT_VOCAB as VOCAB
from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.targets import FAMILIES, hf_greedy


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_loads_ready_for_inference(tmp_path: Path, family: str) -> None:
    loaded = load_target(make_checkpoint(tmp_path, family), device="cpu")
    assert isinstance(loaded, LoadedModel)
    assert loaded.model.config.model_type == FAMILIES[family].model_type
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    assert str(tmp_path) in loaded.source
    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.shape == (1, ids.shape[1], VOCAB)


def test_device_defaults_to_cuda_when_available(llama_dir: Path) -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert load_target(llama_dir).model.device.type == expected


@pytest.mark.parametrize(
    ("saved", "recorded", "requested", "expected"),
    [
        (torch.float32, "float32", "auto", torch.float32),
        (torch.bfloat16, "bfloat16", "auto", torch.bfloat16),
        (torch.float16, "float16", "auto", torch.float32),  # float16 on CPU is slow and incomplete
        (torch.bfloat16, None, "auto", torch.float32),  # nothing recorded
        (torch.float32, "float32", "bfloat16", torch.bfloat16),
        (torch.bfloat16, "bfloat16", "float32", torch.float32),
        (torch.float32, "float32", "float16", torch.float16),  # asked for explicitly: honoured
    ],
)
def test_dtype(
    tmp_path: Path, saved: torch.dtype, recorded: str | None, requested: str, expected: torch.dtype
) -> None:
    make_checkpoint(tmp_path, dtype=saved)
    edit_config(tmp_path, dtype=recorded)
    assert load_target(tmp_path, dtype=requested, device="cpu").model.dtype == expected


@pytest.mark.parametrize(("native", "kernels"), [(True, True), (False, True), (True, False), (False, False)])
def test_auto_loads_gguf_targets_in_bfloat16_where_the_device_or_the_block_kernels_compute_it(
    monkeypatch, native, kernels
) -> None:
    """A GGUF records no dtype, and its quantized blocks run fastest in bf16 on our kernels, which any
    AVX2 CPU runs (dense float32 was 5x slower there); without either, float32."""
    from diffdraft.target import loading

    asked = []
    monkeypatch.setattr(loading, "native_bfloat16", lambda device: native)
    monkeypatch.setattr(loading, "cpu_supported", lambda: kernels)
    monkeypatch.setattr(loading, "default_model_dir", lambda: Path("unused"))
    monkeypatch.setattr(
        loading, "_load_directory", lambda path, dtype, device: asked.append(dtype) or SimpleNamespace()
    )
    loading._load("default", "auto", "cpu")
    loading._load("default", "float32", "cpu")  # asked for explicitly: honoured
    assert asked == ["bfloat16" if native or kernels else "float32", "float32"]


def test_auto_reads_the_legacy_torch_dtype_key(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, dtype=torch.bfloat16)
    edit_config(tmp_path, dtype=None, torch_dtype="bfloat16")
    assert load_target(tmp_path, device="cpu").model.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["fp16", "float64", "int8", ""])
def test_unknown_dtype_names_the_allowed_values(llama_dir: Path, dtype: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"auto.*float32.*bfloat16.*float16"):
        load_target(llama_dir, dtype=dtype)


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "Qwen" / "Qwen3-0.6B"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_target(missing)
    assert str(missing) in str(info.value)
    assert "'default'" in str(info.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json") as info:
        load_target(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_config_without_weights(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights.*model\.safetensors") as info:
        load_target(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    make_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
        load_target(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "again" in str(info.value)


@pytest.mark.parametrize(
    "config_change",
    [{"model_type": "florbnet"}, {"model_type": None}, {"model_type": "t5"}],
    ids=["unknown-model-type", "no-model-type", "not-a-causal-lm"],
)
def test_unsupported_architecture(tmp_path: Path, config_change: dict) -> None:
    make_checkpoint(tmp_path)
    edit_config(tmp_path, **config_change)
    with pytest.raises(CheckpointError, match="unsupported architecture") as info:
        load_target(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "Qwen3" in str(info.value)


def test_missing_tokenizer(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_target(tmp_path)


def test_a_weights_file_instead_of_its_directory(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="pass the directory"):
        load_target(tmp_path / "model.safetensors")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="GGUF") as info:
        load_target(bad)
    assert str(bad) in str(info.value)


def _with_eos(generation: object, config: object, tokenizer: object) -> list[int]:
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=generation),
        config=SimpleNamespace(eos_token_id=config),
    )
    return end_token_ids(model, SimpleNamespace(eos_token_id=tokenizer))


def test_end_token_ids_is_the_sorted_union() -> None:
    assert _with_eos([7, 2], 3, 2) == [2, 3, 7]
    assert _with_eos(5, [5, 9], None) == [5, 9]
    assert _with_eos(None, None, 4) == [4]
    assert _with_eos(None, None, None) == []


def test_end_token_ids_of_a_loaded_model(llama_dir: Path) -> None:
    loaded = load_target(llama_dir, device="cpu")
    loaded.model.generation_config.eos_token_id = [4, 2]
    assert end_token_ids(loaded.model, loaded.tokenizer) == [2, 4]


DEFAULT_PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 11173, 30, 2]
"""Token ids of a short chat prompt for the default target."""


@pytest.mark.real_model
def test_the_optimized_default_target_decodes_exactly_like_stock_transformers_in_float32() -> None:
    """In float32 optimizing keeps stock transformers' numbers (no packed or block layers, attention as
    SDPA computes it), so logits and tokens equal stock's bit for bit on any CPU. bfloat16 is compared
    with diffdraft's own decoding instead (the next test): its kernels sum in another order than stock
    transformers' bfloat16 matmuls, whose order depends on the CPU's bfloat16 instructions."""
    stock = load_target("default", dtype="float32").model
    optimized = load_target("default", dtype="float32", optimize=True).model
    assert optimized.config._attn_implementation == NAME
    assert not has_packed_layers(optimized)
    ids = torch.tensor([DEFAULT_PROMPT])
    with torch.inference_mode():
        assert torch.equal(optimized(ids).logits, stock(ids).logits)
    expected = hf_greedy(stock, DEFAULT_PROMPT, 24, eos=None)
    assert hf_greedy(optimized, DEFAULT_PROMPT, 24, eos=None) == expected
    # diffdraft's own loop adds its in-place KV cache to the kernels
    engine = SpeculativeEngine(TargetModel(optimized), None, ChainBuilder())
    stop = StopConditions([], 24, optimized.config.max_position_embeddings, len(DEFAULT_PROMPT))
    assert [t for chunk in engine.run(SequenceSpec(DEFAULT_PROMPT, stop)) for t in chunk] == expected


@pytest.mark.real_model
def test_the_optimized_bf16_default_target_speculates_exactly_like_its_own_plain_decoding() -> None:
    """On the bf16 block kernel the model is the stock bf16 one up to the order of its float32 sums, so
    the exact reference is diffdraft's own plain decoding of the same optimized target: the shipped
    drafter's trees, verified many tokens a forward, commit exactly its tokens."""
    loaded = load_target("default", dtype="bfloat16", optimize=True, block_activations="bf16")
    optimized = loaded.model
    # laid-out (and so stacked) weights need oneDNN bfloat16 or our block kernels (AVX2), absent on some
    # CPUs; grouped attention not
    packs = packing_supported(torch.bfloat16, torch.device("cpu")) or cpu_supported()
    assert has_packed_layers(optimized) == packs
    assert isinstance(optimized.model.layers[0].mlp.up_proj, ProjectionSlice) == packs
    assert optimized.config._attn_implementation == NAME
    request = dict(prompt_token_ids=DEFAULT_PROMPT, max_new_tokens=24, ignore_eos=True)
    plain = SpeculativeGenerator(loaded, "ar").generate(**request)
    drafted = SpeculativeGenerator(loaded, "ddtree", drafter="default", budget=16).generate(**request)
    assert len(plain.token_ids) == 24
    assert drafted.token_ids == plain.token_ids
    assert max(drafted.stats.acceptance_lengths) > 1  # it verified drafts, not one token a round


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")],
)
def test_training_precision_is_bfloat16_only_where_the_cpu_computes_it(
    monkeypatch, avx512_bf16, amx, expected
):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert fastest_dtype("cpu") == expected
    assert native_bfloat16(torch.device("cpu")) == (expected == "bfloat16")


def test_a_torch_without_the_cpu_probes_falls_back_to_float32(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert fastest_dtype("cpu") == "float32"


@pytest.mark.parametrize("kept", [0, 3, 100, 2_000_000])
def test_a_cut_gguf_is_named_truncated_before_transformers_reads_it(tmp_path: Path, kept: int) -> None:
    """The default target's file cut within its header (100 bytes: once a struct.error traceback) or
    within its tensor data (2 MB: once a reshape error after seconds of loading)."""
    from diffdraft.target.default_model import default_gguf_path

    cut = tmp_path / "model.gguf"
    with default_gguf_path().open("rb") as whole:
        cut.write_bytes(whole.read(kept))
    with pytest.raises(CheckpointError, match="is truncated") as info:
        load_target(cut)
    assert str(info.value).startswith(str(cut)) and "download it again" in str(info.value)
