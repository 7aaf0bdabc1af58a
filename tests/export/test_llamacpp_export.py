"""llama.cpp export: one GGUF file of architecture ``dflash`` holding every key and tensor llama.cpp's
loader reads (src/models/dflash.cpp), the target's tokenizer, the refusals, the CLI."""

from __future__ import annotations

import re
import shlex
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from diffdraft.cli import main
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.errors import ExportError, InvalidRequestError
from diffdraft.export import export_drafter
from diffdraft.export.llamacpp import LAYER_NAMES, build, launch, read_target

from diffdraft_testing.drafters import tiny_dflash2, tiny_drafter, tiny_dspark
from diffdraft_testing.llama_cpp import llama_cpp_binary, read_gguf, write_target_gguf
from diffdraft_testing.targets import tiny_target

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab=VOCAB, dtype=torch.float32)


@pytest.fixture(scope="module")
def files(target, tmp_path_factory):
    """Saved drafters by name, and target GGUFs: ``target.gguf`` (llama) and ``gemma3.gguf``."""
    root = tmp_path_factory.mktemp("llamacpp")
    made = {
        "dflash": tiny_drafter(target, layers=2, block_size=8, target_layer_ids=[0, 2]),
        "dflare": tiny_drafter(target, variant=DFLARE, target_layer_ids=[0, 2]),
        "last-layer": tiny_drafter(target, target_layer_ids=[1, 3]),
        "draft-vocab": tiny_drafter(target, target_layer_ids=[0, 1], draft_vocab=[3, 7, 8, 30]),
        "bf16": tiny_drafter(target, target_layer_ids=[0, 2]).to(torch.bfloat16),
    }
    for name, model in made.items():
        save_draft_model(model, root / name)
    write_target_gguf(root / "target.gguf", target)
    write_target_gguf(root / "gemma3.gguf", target, arch="gemma3")
    return root


def test_the_gguf_holds_every_key_and_tensor_llama_cpp_reads(files, tmp_path):
    """Keys: src/llama-model.cpp load_hparams and src/models/dflash.cpp load_arch_hparams (the sizes,
    dflash.block_size, dflash.target_layers = DFlash id + 1 as conversion/qwen.py writes them), the
    mask id from the draft's vocabulary (common/speculative.cpp). Tensors: load_arch_tensors's names;
    a GGUF shape lists ggml's ne, the reverse of torch's."""
    out = tmp_path / "drafter.gguf"
    export = export_drafter(files / "dflash", "llama.cpp", out, target=files / "target.gguf")
    model = load_draft_model(files / "dflash")
    config = model.config
    fields, tensors = read_gguf(out)
    expected = {
        "general.architecture": "dflash",
        "general.name": "diffdraft DFlash drafter",
        "dflash.context_length": config.max_position_embeddings,
        "dflash.embedding_length": 32,
        "dflash.block_count": 2,
        "dflash.feed_forward_length": 64,
        "dflash.attention.head_count": 4,
        "dflash.attention.head_count_kv": 2,
        "dflash.attention.key_length": 8,
        "dflash.attention.value_length": 8,
        "dflash.attention.causal": False,
        "dflash.hidden_activation": "silu",
        "dflash.block_size": 8,
        "dflash.target_layers": [1, 3],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
        "tokenizer.ggml.token_type": [1] * VOCAB,
        "tokenizer.ggml.merges": ["t 1"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": VOCAB - 1,
        "tokenizer.ggml.mask_token_id": VOCAB - 2,
    }
    floats = {
        "dflash.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "dflash.rope.freq_base": config.rope_parameters["rope_theta"],
    }
    assert set(fields) == set(expected) | set(floats)
    for key, value in expected.items():
        assert fields[key] == value, key
    for key, value in floats.items():
        assert fields[key] == pytest.approx(value, rel=1e-6), key
    assert export.metadata["dflash.target_layers"] == [1, 3]

    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight"}
    names["norm.weight"] = "output_norm.weight"
    for i in range(2):
        names |= {f"layers.{i}.{ours}": f"blk.{i}.{theirs}" for ours, theirs in LAYER_NAMES.items()}
    ours = model.state_dict()
    assert set(tensors) == set(names.values())  # no token_embd / output: the target's are shared
    for name, gguf_name in names.items():
        tensor = tensors[gguf_name]
        assert tensor.tensor_type == GGMLQuantizationType.F32, gguf_name
        assert list(tensor.shape) == list(reversed(ours[name].shape)), gguf_name
        written = torch.from_numpy(np.array(tensor.data)).reshape(ours[name].shape)
        torch.testing.assert_close(written, ours[name], rtol=0, atol=0)
    assert list(tensors["fc.weight"].shape) == [64, 32]  # {n_embd_inp = 2 taps * 32, n_embd}
    assert [p.name for p in tmp_path.iterdir()] == ["drafter.gguf"], "no temporary file is left"


def test_a_bfloat16_drafter_keeps_its_matrices_bfloat16_and_norms_float32(files, tmp_path):
    out = tmp_path / "drafter.gguf"
    export_drafter(files / "bf16", "llama.cpp", out, target=files / "target.gguf")
    ours = load_draft_model(files / "bf16").state_dict()
    _, tensors = read_gguf(out)
    fc = tensors["fc.weight"]
    assert fc.tensor_type == GGMLQuantizationType.BF16
    bits = torch.from_numpy(np.array(fc.data).view(np.int16).copy()).reshape(ours["fc.weight"].shape)
    torch.testing.assert_close(bits.view(torch.bfloat16), ours["fc.weight"], rtol=0, atol=0)
    norm = tensors["output_norm.weight"]
    assert norm.tensor_type == GGMLQuantizationType.F32
    torch.testing.assert_close(torch.from_numpy(np.array(norm.data)), ours["norm.weight"].float())


def test_a_draft_vocabulary_is_d2t_absolute_ids_and_the_targets_head_rows(files, target, tmp_path):
    """src/models/dflash.cpp: d2t is I64 of draft-vocabulary length, ggml_set_rows puts draft row i at
    target id d2t[i]; output is {n_embd, n_vocab_draft}."""
    out = tmp_path / "drafter.gguf"
    export_drafter(files / "draft-vocab", "llama.cpp", out, target=files / "target.gguf")
    _, tensors = read_gguf(out)
    d2t = tensors["d2t"]
    assert d2t.tensor_type == GGMLQuantizationType.I64
    assert np.array(d2t.data).tolist() == [3, 7, 8, 30]
    head = tensors["output.weight"]
    assert list(head.shape) == [32, 4]
    rows = torch.from_numpy(np.array(head.data)).reshape(4, 32)
    torch.testing.assert_close(rows, target.lm_head.weight.detach()[[3, 7, 8, 30]], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("drafter", "gguf", "error", "message"),
    [
        ("dflare", "target.gguf", ExportError, "this is a DFlare drafter"),
        ("last-layer", "target.gguf", ExportError, r"target_layer_ids \[3\] cannot be served"),
        ("dflash", "gemma3.gguf", ExportError, r"no layer inputs for a 'gemma3' target"),
        ("dflash", None, ExportError, r"pass --target TARGET\.gguf"),
        ("dflash", "dflash", ExportError, r"is not a \.gguf file"),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_writing_nothing(files, tmp_path, drafter, gguf, error, message):
    with pytest.raises(error, match=message):
        export_drafter(files / drafter, "llama.cpp", tmp_path / "d.gguf", target=gguf and files / gguf)
    assert list(tmp_path.iterdir()) == []


def test_a_mask_id_outside_the_vocabulary_is_refused(files, target, tmp_path):
    model = tiny_drafter(target, target_layer_ids=[0, 2])
    model.mask_token_id = VOCAB + 5
    with pytest.raises(ExportError, match=r"mask_token_id 69 lies outside the target's vocabulary of 64"):
        build(model, read_target(files / "target.gguf", need_head=False))


@pytest.mark.parametrize(
    ("out", "message"),
    [("dir", "is a directory"), ("drafter.bin", r"does not end in \.gguf"), ("old.gguf", r"exists.*--force")],
)
def test_a_wrong_out_is_refused(files, tmp_path, out, message):
    (tmp_path / "dir").mkdir()
    (tmp_path / "old.gguf").write_text("mine")
    with pytest.raises(InvalidRequestError, match=message):
        export_drafter(files / "dflash", "llama.cpp", tmp_path / out, target=files / "target.gguf")
    assert (tmp_path / "old.gguf").read_text() == "mine"
    export_drafter(files / "dflash", "llama.cpp", tmp_path / "old.gguf", True, files / "target.gguf")
    assert read_gguf(tmp_path / "old.gguf")[0]["general.architecture"] == "dflash"


def test_the_launch_line_serves_the_target_gguf_with_the_draft(tmp_path):
    """docs/speculative.md's DFlash example; common/speculative.cpp clamps n-max to block_size - 1."""
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16}
    command = shlex.split(launch(tmp_path / "my drafter.gguf", config, "/models/target.gguf"))
    assert command[:5] == [
        "llama-server",
        "-m",
        "/models/target.gguf",
        "-md",
        str(tmp_path / "my drafter.gguf"),
    ]
    assert command[command.index("--spec-type") + 1] == "draft-dflash"
    assert command[command.index("--spec-draft-n-max") + 1] == "15"


def test_the_cli_exits_0_with_the_launch_line(files, tmp_path, capsys):
    out = tmp_path / "drafter.gguf"
    target = files / "target.gguf"
    argv = [
        "export",
        str(files / "dflash"),
        "--format",
        "llama.cpp",
        "--out",
        str(out),
        "--target",
        str(target),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "block size 8" in printed
    assert f"llama-server -m {target.resolve()} -md {out.resolve()} --spec-type draft-dflash" in printed
    assert "--spec-draft-n-max 7" in printed and "the target GGUF given with --target" in printed


@pytest.mark.parametrize("argv", [["--target", "gemma3.gguf"], []])
def test_the_cli_exits_2_with_one_line_and_writes_nothing(files, tmp_path, capsys, argv):
    argv = [files / a if a.endswith(".gguf") else a for a in argv]
    out = tmp_path / "drafter.gguf"
    assert (
        main(["export", str(files / "dflash"), "--format", "llama.cpp", "--out", str(out), *map(str, argv)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("diffdraft: error: ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.real_model
def test_llama_cpp_runs_the_exported_drafter_beside_the_default_target(tmp_path):
    speculative = llama_cpp_binary("llama-speculative-simple")
    from diffdraft.target.default_model import default_gguf_path
    from diffdraft.target.loading import load_target

    target = load_target("default", dtype="float32").model
    save_draft_model(tiny_drafter(target, block_size=8, target_layer_ids=[1, 14, 27]).float(), tmp_path / "d")
    assert main(["export", str(tmp_path / "d"), "--format", "llama.cpp", "--out", str(tmp_path / "d.gguf"),
                 "--target", "default"]) == 0  # fmt: skip
    run = subprocess.run(
        [str(speculative), "-m", str(default_gguf_path()), "-md", str(tmp_path / "d.gguf"),
         "--spec-type", "draft-dflash", "--spec-draft-n-max", "7", "-p", "def f(n):", "-n", "8", "-t", "2",
         "--temp", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    mask = target.config.vocab_size - 2  # what tiny_drafter gives this vocabulary
    assert f"block_size=8, mask_token_id={mask}, n_extract=3" in run.stdout + run.stderr
    assert "n_drafted =" in run.stdout + run.stderr  # it drafted with the file


DEFAULT_TAPS = [1, 14, 27]
"""Layers of the default target (SmolLM2-135M, 30 layers) the drafters below read, as the DFlash run's."""
PROMPT = "def f(n):"
BESIDE_DEFAULT = {
    "dflash2": (
        lambda target: tiny_dflash2(target, block_size=8, target_layer_ids=DEFAULT_TAPS),
        "sample_from_anchor=true",
        "DFlash2 conv kernel = 3, group = 144, selector rank = 8, top-k = 6",
    ),
    "dspark": (
        lambda target: tiny_dspark(target, block_size=8, target_layer_ids=DEFAULT_TAPS),
        "sample_from_anchor=true",
        "DFlash with DSpark markov head (rank = 8)",
    ),
    "dspark-reduced-fill-in": (
        lambda target: tiny_dspark(
            target,
            block_size=8,
            target_layer_ids=DEFAULT_TAPS,
            draft_vocab=list(range(0, target.config.vocab_size, 64)),
            sample_from_anchor=False,
        ),
        "sample_from_anchor=false",
        "DFlash using d2t mapping (draft_vocab_size = 768)",
    ),
}
"""Drafters of the default target's shape: a DFlash2 one, a DSpark one (the target's head, a confidence
head, the anchor-first block) and a DSpark one with a reduced vocabulary (its own head and d2t) and
DFlash's block; what llama.cpp logs of the block and of the layout it loaded."""


@pytest.fixture(scope="module")
def default_greedy():
    """The default target loaded in float32, and what greedy decoding without speculation gives after
    :data:`PROMPT` in 16 tokens: our ``ar``'s text, and llama.cpp's stdout (prompt and text)."""
    completion = llama_cpp_binary("llama-completion")
    from diffdraft.generator import SpeculativeGenerator
    from diffdraft.target.default_model import default_gguf_path
    from diffdraft.target.loading import load_target

    loaded = load_target("default", dtype="float32")
    ar = SpeculativeGenerator(loaded, "ar").generate(prompt=PROMPT, max_new_tokens=16, ignore_eos=True)
    run = subprocess.run(
        [str(completion), "-m", str(default_gguf_path()), "-p", PROMPT, "-n", "16", "-t", "2", "--temp", "0",
         "-no-cnv"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return loaded, ar, run.stdout


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(BESIDE_DEFAULT))
def test_llama_cpp_runs_exported_dflash2_and_dspark_drafters_losslessly(
    default_greedy, tmp_path, capsys, name
):
    """Each drafter, exported with the CLI, is run by ``llama-speculative-simple`` beside the default
    target's GGUF with the launch line's --spec-type and --spec-draft-n-max: llama.cpp loads the
    layout, drafts, and its greedy text is its own and our ``ar``'s without speculation."""
    speculative = llama_cpp_binary("llama-speculative-simple")
    from diffdraft.target.default_model import default_gguf_path

    loaded, ar, plain = default_greedy
    make, block, layout = BESIDE_DEFAULT[name]
    save_draft_model(make(loaded.model).float(), tmp_path / "d")
    out = tmp_path / "d.gguf"
    assert main(["export", str(tmp_path / "d"), "--format", "llama.cpp", "--out", str(out), "--target",
                 "default"]) == 0  # fmt: skip
    line = shlex.split(
        next(s for s in capsys.readouterr().out.splitlines() if "llama-server" in s).split(": ", 1)[1]
    )
    kind, n_max = line[line.index("--spec-type") + 1], line[line.index("--spec-draft-n-max") + 1]
    assert kind == ("draft-dflash" if name == "dflash2" else "draft-dspark")
    run = subprocess.run(
        [str(speculative), "-m", str(default_gguf_path()), "-md", str(out), "--spec-type", kind,
         "--spec-draft-n-max", n_max, "-p", PROMPT, "-n", "8", "-t", "2", "--temp", "0", "-lv", "4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, run.stderr[-2000:]
    assert layout in log  # load_arch_tensors read the layout's own tensors
    assert f"adding speculative implementation '{kind}'" in log
    mask = loaded.model.config.vocab_size - 2
    assert f"block_size=8, mask_token_id={mask}, n_extract=3, {block}" in log
    assert "clamping" not in log, "the launch line's --spec-draft-n-max is what a block drafts"
    drafted = int(re.search(r"n_drafted = +(\d+)", run.stderr).group(1))
    accepted = int(re.search(r"n_accept += +(\d+)", run.stderr).group(1))
    predicted = int(re.search(r"n_predict = +(\d+)", run.stderr).group(1))
    assert drafted > 0 and 0 <= accepted <= drafted and predicted >= 8  # it drafted with the file
    # stdout: "\n\n", the prompt and the text, then "\n\n" twice (examples/speculative-simple)
    text = run.stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    tokens = loaded.tokenizer
    assert text.startswith(PROMPT + tokens.decode(ar.token_ids[:8])), text  # at least 8 tokens, as ar's
    assert (PROMPT + ar.text).startswith(text), text  # and no other token, as ar's 16
    assert plain.startswith(PROMPT + ar.text), plain  # llama.cpp without speculation, as ar
