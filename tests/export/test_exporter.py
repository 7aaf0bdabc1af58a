"""``export_drafter``: the written directory holds our weights unchanged, and every refusal is a clear
error that writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.errors import ExportError, IncompatibleDrafterError, InvalidRequestError
from diffdraft.export import ENGINES, export_drafter
from diffdraft.target.loading import load_target

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_dart, tiny_drafter
from diffdraft_testing.targets import tiny_target

DIRECTORY_ENGINES = sorted(set(ENGINES) - {"llama.cpp"})
"""The engines that load a directory (llama.cpp's one GGUF file is tested in test_llamacpp_export.py)."""


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", layers=4, dtype=torch.float32)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """Checkpoint directories by name: a servable DFlash drafter and one of each refused kind."""
    root = tmp_path_factory.mktemp("drafters")
    made = {
        "dflash": tiny_drafter(target, layers=2, block_size=6, target_layer_ids=[0, 1, 2]),
        "dflare": tiny_drafter(target, layers=2, variant=DFLARE, target_layer_ids=[0, 1, 2]),
        "dart": tiny_dart(target),
        "deer": deer_from_causal_lm(target, 1, 4, 0, None, "tiny target"),
        "last-layer": tiny_drafter(target, target_layer_ids=[1, 3]),
    }
    for name, model in made.items():
        save_draft_model(model, root / name)
    return root


@pytest.mark.parametrize("engine", DIRECTORY_ENGINES)
def test_exported_weights_equal_ours_tensor_by_tensor(drafters, tmp_path, engine):
    out = tmp_path / "out"
    export_drafter(drafters / "dflash", engine, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    ours = load_draft_model(drafters / "dflash").state_dict()
    written = load_file(out / "model.safetensors")
    assert set(written) == set(ours)
    for name, tensor in ours.items():
        assert written[name].dtype == tensor.dtype
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    reloaded = load_draft_model(out)  # an official DFlash checkpoint, which our loader reads unchanged
    for name, tensor in ours.items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if p.name != "out"], "no temporary directory is left"


@pytest.mark.parametrize("engine", DIRECTORY_ENGINES)
@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        ("dflare", "DFlare drafter"),
        ("dart", "DART drafter"),
        ("deer", "DEER drafter"),
        ("last-layer", r"target_layer_ids \[3\] cannot be served"),
    ],
)
def test_what_the_engines_cannot_run_is_refused_writing_nothing(drafters, tmp_path, engine, drafter, message):
    with pytest.raises(ExportError, match=message):
        export_drafter(drafters / drafter, engine, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_shipped_default_drafter_is_dflare_and_refused(tmp_path):
    with pytest.raises(ExportError, match="DFlare drafter"):
        export_drafter("default", "vllm", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_out_is_kept_unless_forced(drafters, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InvalidRequestError, match=r"not empty.*--force"):
        export_drafter(drafters / "dflash", "sglang", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    export_drafter(drafters / "dflash", "sglang", out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_out_that_is_a_file_is_refused(drafters, tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(InvalidRequestError, match="is a file"):
        export_drafter(drafters / "dflash", "vllm", tmp_path / "out", force=True)
    assert (tmp_path / "out").read_text() == "x"


def test_a_drafter_for_another_target_is_refused(drafters, tmp_path):
    other = make_checkpoint(tmp_path / "other-target")  # vocabulary 320, the drafter's is 64
    with pytest.raises(IncompatibleDrafterError, match="vocab size"):
        export_drafter(drafters / "dflash", "vllm", tmp_path / "out", target=other)
    assert not (tmp_path / "out").exists()


def test_a_draft_vocabulary_goes_to_vllm_with_the_target_and_is_refused_by_sglang(tmp_path):
    target_dir = make_checkpoint(tmp_path / "target")
    model = tiny_drafter(load_target(target_dir).model, target_layer_ids=[0], draft_vocab=[4, 8, 15, 16])
    save_draft_model(model, tmp_path / "drafter")
    with pytest.raises(ExportError, match="--format vllm"):
        export_drafter(tmp_path / "drafter", "sglang", tmp_path / "sglang", target=target_dir)
    assert not (tmp_path / "sglang").exists()
    export_drafter(tmp_path / "drafter", "vllm", tmp_path / "vllm", target=target_dir)
    written = load_file(tmp_path / "vllm" / "model.safetensors")
    assert (torch.arange(4) + written["d2t"]).tolist() == [4, 8, 15, 16]
    assert written["lm_head.weight"].shape == (4, 32)
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["draft_vocab_size"] == 4


def test_full_vocabulary_drops_the_draft_vocabulary_keeping_what_its_rows_score(tmp_path):
    from diffdraft.drafters.dflash_model import draft_head
    from diffdraft.export.layout import without_draft_vocabulary

    target_dir = make_checkpoint(tmp_path / "target")
    lm_head = load_target(target_dir).model.get_output_embeddings()
    model = tiny_drafter(load_target(target_dir).model, target_layer_ids=[0], draft_vocab=[4, 8, 15, 16])
    whole = without_draft_vocabulary(model)
    assert whole.draft_vocab is None and model.draft_vocab is not None  # the drafter itself is kept
    hidden = torch.randn(3, 32)
    restricted, full = draft_head(lm_head, model.draft_vocab)(hidden), draft_head(lm_head, None)(hidden)
    torch.testing.assert_close(full[:, [4, 8, 15, 16]], restricted)
    for name, tensor in whole.state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0)
    save_draft_model(model, tmp_path / "drafter")
    export_drafter(
        tmp_path / "drafter", "sglang", tmp_path / "sglang", target=target_dir, full_vocabulary=True
    )
    assert load_draft_model(tmp_path / "sglang").draft_vocab is None
