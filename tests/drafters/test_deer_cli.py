"""``diffdraft deer init|info`` on tiny checkpoints; bad input exits 2 with one line and writes nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from diffdraft.cli import main
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.deer_model import DEERDraftModel
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import CHECKPOINT_VOCAB, make_checkpoint
from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.targets import tiny_target


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Untied Llama whose tokenizer has no spare control token (and fewer tokens than embedding rows)."""
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _rebuilt(path, tokenizer, **config_changes):
    """The checkpoint at ``path`` with ``tokenizer`` and fresh weights for the changed config."""
    tokenizer.save_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    for name, value in config_changes.items():
        setattr(config, name, value)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """Tied Qwen3 (like the SmolLM2 default): an embedding row for each token, one an unused control token."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<extra_0>"], special_tokens=True)
    return _rebuilt(path, tokenizer, tie_word_embeddings=True, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    """Qwen2.5's layout in small: an embedding padded past the tokenizer, whose last added token
    (``<|file_sep|>``) is plain text in repository-level code."""
    path = make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<|fim_prefix|>", "<|repo_name|>", "<|file_sep|>"])
    assert len(tokenizer) < CHECKPOINT_VOCAB
    return _rebuilt(path, tokenizer)


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory):
    """An embedding row for each token and no spare control token: nothing to mask with."""
    path = make_checkpoint(tmp_path_factory.mktemp("full"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return _rebuilt(path, tokenizer, vocab_size=len(tokenizer))


def init_args(base, out, *extra):
    return ["deer", "init", "--from", str(base), "--out", str(out), *extra]


def _one_line_error(capsys) -> str:
    """Ours is one line; transformers' own "Loading weights" bar may precede it once MODEL has loaded."""
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if not line.startswith("Loading weights")]
    assert len(err) == 1 and err[0].startswith("diffdraft: error: ")
    return err[0]


def _assert_copied(drafter: DEERDraftModel, base: torch.nn.Module, layers: int) -> None:
    ours, theirs = drafter.state_dict(), base.state_dict()
    assert not any(k.startswith(f"model.layers.{layers}.") for k in ours)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key].to(value.dtype), rtol=0, atol=0, msg=key)
    torch.testing.assert_close(drafter.lm_head.weight, base.lm_head.weight.to(drafter.lm_head.weight.dtype))


def test_init_copies_the_first_layers(checkpoint, tmp_path, capsys):
    out = tmp_path / "drafter"
    args = init_args(
        checkpoint,
        out,
        "--num-layers",
        "1",
        "--mask-token-id",
        "7",
        "--block-size",
        "4",
        "--denoising-steps",
        "2",
    )
    assert main(args) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    assert f"wrote {out}" in printed[0] and "1/2 layers" in printed[0]
    assert "block size 4" in printed[0] and "mask token 7" in printed[0]

    drafter = load_draft_model(out)
    assert isinstance(drafter, DEERDraftModel)
    assert drafter.config.num_hidden_layers == 1 and len(drafter.model.layers) == 1
    assert drafter.block_size == 4 and drafter.mask_token_id == 7 and drafter.denoising_steps == 2
    assert drafter.lm_head.weight.dtype == torch.float32 and not drafter.tied
    settings = drafter.config.deer_config
    assert settings["base_architectures"] == ["LlamaForCausalLM"]
    assert settings["initialized_from"] == str(checkpoint)
    assert drafter.tokenizer_fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(checkpoint))
    _assert_copied(drafter, AutoModelForCausalLM.from_pretrained(checkpoint), layers=1)
    assert f"{sum(p.numel() for p in drafter.parameters()):,} parameters" in printed[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temp dir left beside it
    (tmp_path / "plain").mkdir()
    assert out.stat().st_mode == (tmp_path / "plain").stat().st_mode  # the umask's mode, not a temp dir's

    assert main(["deer", "info", str(out)]) == 0
    info = capsys.readouterr().out
    for line in (
        f"drafter: {out}",
        "block size: 4",
        "layers: 1",
        f"parameters: {sum(p.numel() for p in drafter.parameters()):,} (float32)",
        "mask token: 7",
        "base architectures: LlamaForCausalLM",
        f"initialized from: {checkpoint}",
        f"tokenizer fingerprint: {drafter.tokenizer_fingerprint}",
    ):
        assert line in info


def test_init_masks_with_an_unused_embedding_row_and_says_why(qwen2_checkpoint, tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(init_args(qwen2_checkpoint, out, "--num-layers", "1")) == 0
    tokens = len(AutoTokenizer.from_pretrained(qwen2_checkpoint))
    assert (
        f"mask token {tokens} (an unused embedding row: the embedding has {CHECKPOINT_VOCAB} rows and the "
        f"tokenizer {tokens} tokens, so no text encodes to ids {tokens} and up)"
    ) in capsys.readouterr().out
    assert load_draft_model(out).mask_token_id == tokens
    last = str(CHECKPOINT_VOCAB - 1)  # given, a row beyond the tokenizer is named as such
    given = init_args(qwen2_checkpoint, out, "--num-layers", "1", "--mask-token-id", last, "--force")
    assert main(given) == 0
    assert f"mask token {last} (an id no text encodes to)" in capsys.readouterr().out


def test_init_picks_the_mask_token_and_keeps_a_tied_head(tied_checkpoint, tmp_path, capsys):
    out = tmp_path / "drafter"
    args = init_args(tied_checkpoint, out, "--num-layers", "2", "--dtype", "bfloat16")
    assert main(args) == 0
    tokenizer = AutoTokenizer.from_pretrained(tied_checkpoint)
    spare = tokenizer.convert_tokens_to_ids("<extra_0>")
    assert (
        f"mask token {spare} ('<extra_0>', an added control token outside the chat format, since the "
        f"embedding has no row beyond the tokenizer's {len(tokenizer)} tokens;"
    ) in capsys.readouterr().out
    drafter = load_draft_model(out)
    assert drafter.mask_token_id == spare and drafter.block_size == 16
    assert drafter.tied and drafter.lm_head.weight is drafter.model.embed_tokens.weight
    assert drafter.lm_head.weight.dtype == torch.bfloat16
    _assert_copied(drafter, AutoModelForCausalLM.from_pretrained(tied_checkpoint), layers=2)


def test_force_replaces_a_non_empty_out(checkpoint, tmp_path, capsys):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "notes.txt").write_text("old")
    assert main([*init_args(checkpoint, out, "--num-layers", "2", "--mask-token-id", "3"), "--force"]) == 0
    assert not (out / "notes.txt").exists()
    assert load_draft_model(out).config.num_hidden_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


@pytest.mark.parametrize(
    ("extra", "fix"),
    [
        (["--num-layers", "0", "--mask-token-id", "3"], "--num-layers must be between 1 and 2"),
        (["--num-layers", "3", "--mask-token-id", "3"], "--num-layers must be between 1 and 2"),
        (
            ["--num-layers", "1", "--mask-token-id", "3", "--block-size", "0"],
            "--block-size must be at least 1",
        ),
        (
            ["--num-layers", "1", "--mask-token-id", "3", "--denoising-steps", "0"],
            "--denoising-steps must be at least 1",
        ),
        (["--num-layers", "1", "--mask-token-id", str(CHECKPOINT_VOCAB)], "leave it out to pick one"),
        (["--num-layers", "1", "--mask-token-id", "-1"], "leave it out to pick one"),
    ],
)
def test_bad_settings_exit_2_and_write_nothing(checkpoint, tmp_path, capsys, extra, fix):
    assert main(init_args(checkpoint, tmp_path / "drafter", *extra)) == 2
    assert fix in _one_line_error(capsys)
    assert not any(tmp_path.iterdir())


def test_a_model_with_nothing_to_mask_with_asks_for_an_id_and_writes_nothing(
    full_checkpoint, tmp_path, capsys
):
    assert main(init_args(full_checkpoint, tmp_path / "drafter", "--num-layers", "1")) == 2
    error = _one_line_error(capsys)
    assert "no row beyond the tokenizer's" in error and "pass --mask-token-id" in error
    assert not any(tmp_path.iterdir())


def test_a_missing_model_exits_2_and_writes_nothing(tmp_path, capsys):
    assert main(init_args(tmp_path / "nowhere", tmp_path / "drafter", "--num-layers", "1")) == 2
    assert "pass 'default', a local Hugging Face model directory" in _one_line_error(capsys)
    assert not any(tmp_path.iterdir())


def test_a_non_empty_out_is_refused_without_force(checkpoint, tmp_path, capsys):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "notes.txt").write_text("old")
    assert main(init_args(checkpoint, out, "--num-layers", "1", "--mask-token-id", "3")) == 2
    assert "pass --force" in _one_line_error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["drafter"] and [p.name for p in out.iterdir()] == [
        "notes.txt"
    ]


def test_info_refuses_what_is_not_a_deer_drafter(tmp_path, capsys):
    assert main(["deer", "info", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in _one_line_error(capsys)
    save_draft_model(tiny_drafter(tiny_target(dtype=torch.float32)), tmp_path / "dflash")
    assert main(["deer", "info", str(tmp_path / "dflash")]) == 2
    assert "not DEER" in _one_line_error(capsys)
