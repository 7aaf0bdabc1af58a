"""DFlash2 export: vLLM's layout round-trips to the same drafts, the GGUF holds the keys and tensors
llama.cpp's loader reads, SGLang (no DFlash2 model) and llama.cpp's selector limit are refused."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors.torch import load_file

from diffdraft.cli import main
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.errors import ExportError
from diffdraft.export import export_drafter

from diffdraft_testing.drafters import DFLASH_LAYER_WEIGHTS, block_log_probs, tiny_dflash2
from diffdraft_testing.llama_cpp import read_gguf, write_target_gguf
from diffdraft_testing.targets import tiny_target

SCALES = {"input_embedding_scale": 1.5, "output_multiplier": 0.8, "final_logit_softcapping": 4.0}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, dtype=torch.float32)


@pytest.fixture(scope="module")
def files(target, tmp_path_factory):
    """Saved DFlash2 drafters (``scaled``: every optional scale set; ``top6``: a selector too wide for
    llama.cpp at hidden size 32) and the target's GGUF."""
    root = tmp_path_factory.mktemp("dflash2")
    scaled = tiny_dflash2(target, selector_top_k=4, target_layer_ids=[0, 2])
    scaled.config.dflash_config |= SCALES  # the loaded network (what is compared) reads them
    save_draft_model(scaled, root / "scaled")
    save_draft_model(tiny_dflash2(target, target_layer_ids=[0, 2]), root / "top6")
    write_target_gguf(root / "target.gguf", target)
    return root


def test_vllm_gets_its_layout_and_drafts_round_trip_identically(files, target, tmp_path):
    """vllm/model_executor/models/qwen3_dflash2.py: DFlash2Qwen3DecoderLayer reads dflash_config's
    conv_kernel_size / conv_group_size, DFlash2Qwen3Model selector_rank / selector_top_k and
    input_embedding_scale, DFlash2Qwen3ForCausalLM output_multiplier / final_logit_softcapping; the
    weights are ours by name (attention_conv, mlp_conv, candidate_selector.*)."""
    out = tmp_path / "vllm"
    export_drafter(files / "scaled", "vllm", out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 62,
        "target_layer_ids": [0, 2],
        "block_size": 5,
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 4,
        **SCALES,
    }
    assert all(t == "full_attention" for t in config["layer_types"]) and "draft_vocab_size" not in config
    ours = load_draft_model(files / "scaled")
    written = load_file(out / "model.safetensors")
    convs = {
        f"{conv}.{w}"
        for conv in ("attention_conv", "mlp_conv")
        for w in ("base_kernel", "kernel_projection.weight")
    }
    layer = DFLASH_LAYER_WEIGHTS | convs
    top = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    top |= {
        f"candidate_selector.{w}"
        for w in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")
    }
    assert set(written) == top | {f"layers.{i}.{w}" for i in range(2) for w in layer}
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=0)
    reloaded = load_draft_model(out)
    assert (
        reloaded.input_embedding_scale == 1.5
        and reloaded.softcap == 4.0
        and reloaded.output_multiplier == 0.8
    )
    torch.testing.assert_close(
        block_log_probs(reloaded, target), block_log_probs(ours, target), rtol=0, atol=0
    )


def test_the_round_trip_check_sees_a_lost_setting(files, target):
    """block_log_probs tells the scales apart, so the round trip above would fail without them."""
    ours = load_draft_model(files / "scaled")
    plain = load_draft_model(files / "scaled")
    plain.softcap = 0.0
    assert not torch.equal(block_log_probs(plain, target), block_log_probs(ours, target))


def test_sglang_is_refused_writing_nothing(files, tmp_path):
    with pytest.raises(
        ExportError, match=r"SGLang has no DFlash2 model.*--format vllm or --format llama\.cpp"
    ):
        export_drafter(files / "scaled", "sglang", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_gguf_holds_the_keys_and_tensors_llama_cpp_reads(files, tmp_path):
    """src/models/dflash.cpp load_arch_hparams reads dflash.conv_kernel_size, conv_group_size,
    selector_rank, selector_top_k (uint32), logit_scale, final_logit_softcapping, embedding_scale
    (float32); load_arch_tensors takes blk.N.{attn,ffn}_conv_base {n_embd, kernel, 2} (no .weight),
    blk.N.{attn,ffn}_conv_proj.weight {n_embd, 2 * kernel * groups}, selector_predecessor /
    selector_successor.weight {rank, n_vocab} and selector_hidden.weight {n_embd, rank}."""
    out = tmp_path / "drafter.gguf"
    export_drafter(files / "scaled", "llama.cpp", out, target=files / "target.gguf")
    fields, tensors = read_gguf(out)
    assert fields["general.name"] == "diffdraft DFlash2 drafter"
    for key, value in {
        "conv_kernel_size": 3,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 4,
    }.items():
        assert fields[f"dflash.{key}"] == value
    for key, value in {"logit_scale": 0.8, "final_logit_softcapping": 4.0, "embedding_scale": 1.5}.items():
        assert fields[f"dflash.{key}"] == pytest.approx(value)
    reader_types = {name: field.types[0] for name, field in GGUFReader(out).fields.items()}
    assert reader_types["dflash.selector_top_k"] == GGUFValueType.UINT32
    assert reader_types["dflash.logit_scale"] == GGUFValueType.FLOAT32
    assert fields["dflash.block_size"] == 5 and fields["dflash.target_layers"] == [1, 3]
    ours = load_draft_model(files / "scaled").state_dict()
    names = {
        "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
        "candidate_selector.successor_codebook": "selector_successor.weight",
        "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    }
    for i in range(2):
        names |= {
            f"layers.{i}.attention_conv.base_kernel": f"blk.{i}.attn_conv_base",
            f"layers.{i}.attention_conv.kernel_projection.weight": f"blk.{i}.attn_conv_proj.weight",
            f"layers.{i}.mlp_conv.base_kernel": f"blk.{i}.ffn_conv_base",
            f"layers.{i}.mlp_conv.kernel_projection.weight": f"blk.{i}.ffn_conv_proj.weight",
        }
    for name, gguf_name in names.items():
        tensor = tensors[gguf_name]
        assert list(tensor.shape) == list(reversed(ours[name].shape)), gguf_name
        written = torch.from_numpy(np.array(tensor.data)).reshape(ours[name].shape)
        torch.testing.assert_close(written, ours[name], rtol=0, atol=0)
    assert list(tensors["blk.0.attn_conv_base"].shape) == [32, 3, 2]  # {n_embd, kernel, 2}
    assert list(tensors["blk.0.attn_conv_proj.weight"].shape) == [32, 2 * 3 * 4]  # 32 / group size 8
    assert tensors["blk.1.ffn_conv_base"].tensor_type == GGMLQuantizationType.F32
    assert "output.weight" not in tensors and "d2t" not in tensors  # the target's head


def test_a_selector_too_wide_for_the_hidden_size_is_refused_by_llama_cpp(files, tmp_path):
    """load_arch_tensors: n_embd < top_k * (top_k + 1) throws (the lattice row would not fit)."""
    with pytest.raises(ExportError, match=r"top_k \+ top_k\^2 = 42.*hidden size is 32.*--format vllm"):
        export_drafter(files / "top6", "llama.cpp", tmp_path / "d.gguf", target=files / "target.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ("vllm", '"method": "dflash"'),
        ("vllm", '"num_speculative_tokens": 4'),  # the convs' block is 1 + num_speculative_tokens rows
        ("llama.cpp", "--spec-type draft-dflash --spec-draft-n-max 4"),
    ],
)
def test_the_cli_prints_the_launch_line(files, tmp_path, capsys, engine, expected):
    out = tmp_path / ("d.gguf" if engine == "llama.cpp" else "out")
    argv = ["export", str(files / "scaled"), "--format", engine, "--out", str(out)]
    argv += ["--target", str(files / "target.gguf")] if engine == "llama.cpp" else []
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "DFlash2DraftModel for" in printed and "block size 5" in printed and "[0, 2]" in printed
    launch = next(line for line in printed.splitlines() if line.startswith("launch: "))
    assert expected in " ".join(shlex.split(launch))
