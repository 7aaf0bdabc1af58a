"""DSpark export: vLLM's layout round-trips to the same drafts (whole vocabulary, a reduced one with
its own head, DFlash's block), SGLang gets the same config where its DSpark can run the drafter, the
GGUF holds the keys and tensors llama.cpp's loader reads, and what an engine lacks is refused."""

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

from diffdraft_testing.drafters import block_log_probs, tiny_dspark
from diffdraft_testing.llama_cpp import read_gguf, write_target_gguf
from diffdraft_testing.targets import tiny_target

HALF = list(range(0, 64, 2))
TAPS = [0, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, dtype=torch.float32)


def drafter(target, name: str):
    """The named DSpark drafter: ``whole`` (the target's head, with a confidence head), ``reduced``
    (its own head over :data:`HALF` and ``d2t``), ``fill-in`` (DFlash's block), ``own-head`` (a whole-
    vocabulary head of its own), ``scaled`` (``logit_scale`` 1.25), ``top-k`` (``dspark_draft_topk``),
    ``no-confidence``."""
    model = tiny_dspark(
        target,
        seed=len(name),
        target_layer_ids=TAPS,
        draft_vocab=HALF if name in ("reduced", "reduced-scaled") else None,
        sample_from_anchor=name != "fill-in",
        confidence_head=name != "no-confidence",
    )
    if name == "own-head":
        model.use_shipped_head({"lm_head.weight"})
        torch.nn.init.normal_(model.lm_head.weight, std=0.2)
    if name in ("scaled", "reduced-scaled"):
        model.config.logit_scale = 1.25
    if name == "top-k":
        model.config.dspark_draft_topk = 5
    with torch.no_grad():
        for weight in model.markov_head.parameters():
            weight.normal_(std=0.5)  # large enough to weigh in the drafts
    return model


@pytest.fixture(scope="module")
def files(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    names = ("whole", "reduced", "fill-in", "own-head", "scaled", "reduced-scaled", "top-k", "no-confidence")
    for name in names:
        save_draft_model(drafter(target, name), root / name)
    write_target_gguf(root / "target.gguf", target)
    return root


@pytest.mark.parametrize("name", ["whole", "reduced", "fill-in", "own-head", "scaled", "top-k"])
def test_vllm_gets_its_layout_and_drafts_round_trip_identically(files, target, tmp_path, name):
    """vllm/model_executor/models/qwen3_dspark.py (Qwen3DSparkForCausalLM, Qwen3DSparkModel) reads
    markov_rank, draft_vocab_size, logit_scale, enable_confidence_head, confidence_head_with_markov
    at the top level and loads markov_head.*, confidence_head.proj.*, lm_head and d2t by our names."""
    out = tmp_path / "vllm"
    export_drafter(files / name, "vllm", out)
    ours = load_draft_model(files / name)
    written = load_file(out / "model.safetensors")
    assert set(written) == set(ours.state_dict())
    for key, tensor in ours.state_dict().items():
        assert written[key].dtype == tensor.dtype
        torch.testing.assert_close(written[key], tensor, rtol=0, atol=0)
    reloaded = load_draft_model(out)
    assert type(reloaded) is type(ours)
    torch.testing.assert_close(
        block_log_probs(reloaded, target), block_log_probs(ours, target), rtol=0, atol=0
    )


def test_the_config_holds_the_keys_vllm_reads_first(files, tmp_path):
    """vllm/v1/worker/gpu/spec_decode/utils.py takes the noise token from dflash_config.mask_token_id,
    then mask_token_id, then dspark_noise_token_id; eagle3_utils.py takes the taps from
    eagle_aux_hidden_state_layer_ids, dflash_config, dspark_target_layer_ids, then target_layer_ids
    (+ 1): so only the last of each is written. config/speculative.py finds method dspark by the
    architecture Qwen3DSparkModel."""
    export_drafter(files / "reduced", "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    absent = {"dflash_config", "mask_token_id", "eagle_aux_hidden_state_layer_ids", "dspark_target_layer_ids"}
    assert not absent & set(config)
    assert config["dspark_noise_token_id"] == 62 and config["target_layer_ids"] == TAPS
    assert (config["block_size"], config["markov_rank"], config["markov_head_type"]) == (4, 8, "vanilla")
    assert (config["draft_vocab_size"], config["vocab_size"], config["sample_from_anchor"]) == (32, 64, True)
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    assert config["logit_scale"] == 1.0 and "dspark_draft_topk" not in config
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert (torch.arange(32) + written["d2t"]).tolist() == HALF  # vLLM's map_draft_to_target
    assert written["markov_head.markov_w1.weight"].shape == (64, 8)  # indexed by target ids
    assert written["markov_head.markov_w2.weight"].shape == (32, 8)  # scores the draft vocabulary


def test_sglang_gets_the_same_layout_where_its_dspark_runs_the_drafter(files, tmp_path):
    """python/sglang/srt/models/dspark.py (entry class Qwen3DSparkModel) and
    .../dspark_components/dspark_config.py: markov_rank, markov_head_type, dspark_noise_token_id,
    block_size, target_layer_ids; the confidence head is loaded."""
    export_drafter(files / "whole", "sglang", tmp_path / "sglang")
    export_drafter(files / "whole", "vllm", tmp_path / "vllm")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config == json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert {"confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(
        load_file(tmp_path / "sglang" / "model.safetensors")
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("reduced", r"a head of its own over a reduced vocabulary"),
        ("own-head", r"a head of its own over the whole vocabulary"),
        ("scaled", r"logit_scale 1\.25"),
        ("top-k", r"dspark_draft_topk 5"),
        ("fill-in", r"sample_from_anchor false"),
        ("no-confidence", r"no confidence head"),
    ],
)
def test_what_sglangs_dspark_cannot_run_is_refused_writing_nothing(files, tmp_path, name, message):
    with pytest.raises(ExportError, match=rf"{message}.*SGLang's DSpark cannot run.*--format vllm"):
        export_drafter(files / name, "sglang", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_full_vocabulary_cannot_drop_a_reduced_vocabulary(files, tmp_path):
    with pytest.raises(ExportError, match="cannot drop it"):
        export_drafter(files / "reduced", "vllm", tmp_path / "out", full_vocabulary=True)
    assert list(tmp_path.iterdir()) == []


def gguf_of(files, tmp_path, name: str) -> tuple[dict, dict]:
    out = tmp_path / f"{name}.gguf"
    export_drafter(files / name, "llama.cpp", out, target=files / "target.gguf")
    return read_gguf(out)


def as_torch(tensor) -> torch.Tensor:
    """A GGUF tensor in torch's shape (ggml lists the dimensions reversed)."""
    return torch.from_numpy(np.array(tensor.data)).reshape(list(reversed([int(n) for n in tensor.shape])))


def test_the_gguf_holds_the_markov_and_confidence_heads_llama_cpp_reads(files, tmp_path):
    """src/models/dflash.cpp load_arch_tensors: markov_w1.weight {rank, n_vocab}, markov_w2.weight
    {rank, n_vocab_draft}, conf_proj.weight {n_embd + rank, 1} and its bias; common/speculative.cpp
    reads dflash.sample_from_anchor and dflash.has_confidence_head (bool) and picks draft-dspark by
    markov_w1.weight."""
    fields, tensors = gguf_of(files, tmp_path, "whole")
    ours = load_draft_model(files / "whole").state_dict()
    assert fields["general.name"] == "diffdraft DSpark drafter"
    assert fields["dflash.sample_from_anchor"] is True and fields["dflash.has_confidence_head"] is True
    types = {name: field.types[0] for name, field in GGUFReader(tmp_path / "whole.gguf").fields.items()}
    assert types["dflash.sample_from_anchor"] == types["dflash.has_confidence_head"] == GGUFValueType.BOOL
    assert fields["dflash.block_size"] == 4 and fields["dflash.target_layers"] == [1, 3]
    assert fields["tokenizer.ggml.mask_token_id"] == 62  # dspark_noise_token_id
    names = {
        "markov_head.markov_w1.weight": "markov_w1.weight",
        "markov_head.markov_w2.weight": "markov_w2.weight",
        "confidence_head.proj.weight": "conf_proj.weight",
    }
    for name, gguf_name in names.items():
        torch.testing.assert_close(as_torch(tensors[gguf_name]), ours[name], rtol=0, atol=0)
    assert list(tensors["markov_w1.weight"].shape) == [8, 64] and list(tensors["conf_proj.weight"].shape) == [
        40,
        1,
    ]
    assert tensors["conf_proj.bias"].tensor_type == GGMLQuantizationType.F32
    assert "output.weight" not in tensors and "d2t" not in tensors  # the target's head, every token
    assert "dflash.logit_scale" not in fields


def test_a_reduced_vocabulary_is_its_own_head_and_absolute_d2t(files, tmp_path):
    """load_arch_tensors: d2t (I64) sizes the draft vocabulary, output.weight {n_embd, n_vocab_draft};
    conversion/qwen.py's DSparkModel writes d2t as absolute target ids."""
    _, tensors = gguf_of(files, tmp_path, "reduced")
    ours = load_draft_model(files / "reduced").state_dict()
    assert tensors["d2t"].tensor_type == GGMLQuantizationType.I64
    assert np.array(tensors["d2t"].data).tolist() == HALF
    torch.testing.assert_close(as_torch(tensors["output.weight"]), ours["lm_head.weight"], rtol=0, atol=0)
    assert list(tensors["markov_w2.weight"].shape) == [8, 32]


def test_a_whole_vocabulary_head_of_its_own_goes_as_output(files, tmp_path):
    """load_arch_tensors takes output.weight whenever present (the target's only without it)."""
    _, tensors = gguf_of(files, tmp_path, "own-head")
    ours = load_draft_model(files / "own-head").state_dict()
    torch.testing.assert_close(as_torch(tensors["output.weight"]), ours["lm_head.weight"], rtol=0, atol=0)
    assert "d2t" not in tensors


def test_a_logit_scale_is_folded_into_the_drafters_own_head_and_markov_rows(files, tmp_path):
    """build_dspark_markov_head adds markov_w2's bias to the head's logits and scales neither, so
    logit_scale * (head + bias) is the head and markov_w2 each scaled."""
    fields, tensors = gguf_of(files, tmp_path, "reduced-scaled")
    ours = load_draft_model(files / "reduced-scaled")
    hidden, previous = torch.randn(3, 32), torch.tensor([4, 9, 60])
    expected = ours.logit_scale * (ours.lm_head(hidden) + ours.markov_head(previous))
    head, w1, w2 = (as_torch(tensors[n]) for n in ("output.weight", "markov_w1.weight", "markov_w2.weight"))
    torch.testing.assert_close(hidden @ head.T + w1[previous] @ w2.T, expected.detach())
    assert "dflash.logit_scale" not in fields


def test_a_fill_in_block_and_a_confidence_head_without_markov_are_written_as_llama_cpp_reads_them(
    files, tmp_path, target
):
    """sample_from_anchor false: llama.cpp's bonus-anchor block; a confidence head that reads no
    Markov embedding has not the {n_embd + rank, 1} shape load_arch_tensors wants: left out."""
    fields, _ = gguf_of(files, tmp_path, "fill-in")
    assert fields["dflash.sample_from_anchor"] is False
    config = drafter(target, "whole").config
    config.confidence_head_with_markov = False
    save_draft_model(type(drafter(target, "whole"))(config), tmp_path / "plain-confidence")
    assert load_draft_model(tmp_path / "plain-confidence").confidence_head.proj.weight.shape == (1, 32)
    export_drafter(
        tmp_path / "plain-confidence", "llama.cpp", tmp_path / "p.gguf", target=files / "target.gguf"
    )
    fields, tensors = read_gguf(tmp_path / "p.gguf")
    assert fields["dflash.has_confidence_head"] is False and "conf_proj.weight" not in tensors


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("top-k", r"dspark_draft_topk 5.*does not run"),
        ("scaled", r"scales its logits by 1\.25.*the target's"),
    ],
)
def test_what_llama_cpps_dspark_cannot_run_is_refused_writing_nothing(files, tmp_path, name, message):
    with pytest.raises(ExportError, match=rf"{message}.*--format vllm"):
        export_drafter(files / name, "llama.cpp", tmp_path / "d.gguf", target=files / "target.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("engine", "name", "expected"),
    [
        ("vllm", "whole", '"method": "dspark"'),
        ("vllm", "whole", '"num_speculative_tokens": 4'),  # the anchor row predicts: the whole block
        ("vllm", "fill-in", '"num_speculative_tokens": 3'),
        ("sglang", "whole", "--speculative-algorithm DSPARK"),
        ("sglang", "whole", "--speculative-num-draft-tokens 5"),  # gamma (the block) + 1
        ("llama.cpp", "whole", "--spec-type draft-dspark --spec-draft-n-max 4"),
        ("llama.cpp", "fill-in", "--spec-draft-n-max 3"),
    ],
)
def test_the_cli_prints_the_launch_line(files, tmp_path, capsys, engine, name, expected):
    out = tmp_path / ("d.gguf" if engine == "llama.cpp" else "out")
    argv = ["export", str(files / name), "--format", engine, "--out", str(out)]
    argv += ["--target", str(files / "target.gguf")] if engine == "llama.cpp" else []
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Qwen3DSparkModel for" in printed and "block size 4" in printed and str(TAPS) in printed
    launch = next(line for line in printed.splitlines() if line.startswith("launch: "))
    assert expected in " ".join(shlex.split(launch))
