"""``diffdraft train prompts|regenerate`` and ``--config`` files, on a parser built as cli.py builds it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from diffdraft.data.samples import Sample
from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.errors import InvalidRequestError
from diffdraft.target.loading import fastest_dtype
from diffdraft.train import cli as train_cli
from diffdraft.train.cli import process_group_backend, run_train

from diffdraft_testing.checkpoints import CHECKPOINT_VOCAB, make_checkpoint
from diffdraft_testing.drafters import tiny_dflash2
from diffdraft_testing.pickles import RunsCode
from diffdraft_testing.training import parse_train_args

COPIED = " ".join(f"word{i}" for i in range(13))
HELD_OUT = [Sample("p2", "sharegpt", messages=[{"role": "user", "content": "Q: " + COPIED}])]


@pytest.fixture(autouse=True)
def small_held_out_slice(monkeypatch):
    """The bench's real ShareGPT slice costs a read of the whole dump."""
    monkeypatch.setattr(train_cli, "sharegpt_held_out", lambda: HELD_OUT)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src.jsonl"
    records = [
        {"id": "p1", "prompt": "hello"},
        {"id": "p1", "prompt": "hello"},
        {"id": "p2", "prompt": "kept out by id"},
        "oops",
        {"prompt": "fox"},
        {"prompt": "the bench asks: " + COPIED},
    ]
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompts_writes_cleaned_prompts_and_prints_counts(source, tmp_path, capsys):
    out = tmp_path / "prompts.jsonl"
    run_train(parse_train_args(["train", "prompts", "--source", str(source), "--out", str(out)]))
    printed = capsys.readouterr().out
    assert "5 prompts, skipped 1 malformed records" in printed
    assert "dropped 1 duplicate prompts" in printed
    assert "dropped 1 prompts of the bench's ShareGPT slice" in printed
    assert "dropped 1 prompts sharing a 13-gram with HumanEval, MT-Bench or that slice" in printed
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p1", "src:5"]


def test_all_turns_drops_every_turn_of_a_held_out_conversation(tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    with path.open("w") as f:
        for conversation in ("p1", "p2"):
            turns = [{"from": "human", "value": f"Q1 of {conversation}"}, {"from": "gpt", "value": "A1"}]
            turns.append({"from": "human", "value": f"Q2 of {conversation}"})
            f.write(json.dumps({"id": conversation, "conversations": turns}) + "\n")
    out = tmp_path / "prompts.jsonl"
    run_train(parse_train_args(["train", "prompts", "--source", str(path), "--out", str(out), "--all-turns"]))
    assert "dropped 2 prompts of the bench's ShareGPT slice" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p1", "p1/turn-2"]


def test_config_values_are_defaults_that_flags_override(tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"out": "from_config.jsonl", "batch_size": 3, "temperature": 0.2}))
    args = parse_train_args(["train", "regenerate", "--config", str(config), "--batch-size", "5"])
    assert (args.out, args.batch_size, args.temperature) == ("from_config.jsonl", 5, 0.2)
    assert args.max_new_tokens > 0  # untouched options keep their defaults


def test_toml_tables_apply_to_their_sub_command_only(tmp_path):
    config = tmp_path / "train.toml"
    config.write_text(
        'out = "shared.jsonl"\nsource = "sharegpt"\nbatch-size = 4\n\n'
        '[regenerate]\nout = "responses.jsonl"\ndtype = "float32"\n'
    )
    regen = parse_train_args(["train", "regenerate", "--config", str(config)])
    assert (regen.out, regen.source, regen.batch_size, regen.dtype) == (
        "responses.jsonl",
        ["sharegpt"],
        4,
        "float32",
    )
    prompts = parse_train_args(["train", "prompts", "--config", str(config)])
    assert prompts.out == "shared.jsonl" and not hasattr(prompts, "batch_size")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"regenerate": {"batchsize": 4}}', "not an option of 'regenerate'"),
        ('{"dtype": "float64"}', "dtype must be one of"),
        ('{"batch_size": "many"}', "is not a valid int"),
        ("[1, 2]", "must hold an object"),
        ("{broken", "is not valid JSON"),
    ],
)
def test_bad_config_files_exit_with_a_message(tmp_path, capsys, content, message):
    config = tmp_path / "train.json"
    config.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        parse_train_args(["train", "regenerate", "--out", "x.jsonl", "--config", str(config)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_regenerate_resumes_with_the_same_command(source, tmp_path, capsys):
    target = make_checkpoint(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(target)
    out = tmp_path / "responses.jsonl"
    config = tmp_path / "regen.toml"
    config.write_text(
        f'target = "{target}"\nout = "{out}"\nsource = "{source}"\n'
        'dtype = "float32"\nmax-new-tokens = 4\nbatch-size = 2\n'
    )
    argv = ["train", "regenerate", "--config", str(config)]
    run_train(parse_train_args(argv))
    assert "2 samples written" in capsys.readouterr().out
    run_train(parse_train_args(argv))
    assert "0 samples written (0 tokens, 0.0 tok/s), 2 already done" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 2


def test_limit_keeps_the_first_prompts_and_must_be_positive(source, tmp_path):
    out = tmp_path / "prompts.jsonl"
    run_train(
        parse_train_args(["train", "prompts", "--source", str(source), "--out", str(out), "--limit", "1"])
    )
    assert len(out.read_text().splitlines()) == 1
    with pytest.raises(InvalidRequestError, match="--limit must be at least 1"):
        run_train(
            parse_train_args(["train", "prompts", "--source", str(source), "--out", str(out), "--limit", "0"])
        )


@pytest.fixture
def responses(tmp_path):
    """A tiny target and a responses file of its own greedy continuations."""
    import torch
    from transformers import AutoModelForCausalLM

    target_dir = make_checkpoint(tmp_path / "target", "llama")
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    path = tmp_path / "responses.jsonl"
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(10):
            prompt = torch.randint(3, 300, (5,), generator=g)
            out = model.generate(
                prompt[None], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
            )
            record = {
                "id": f"r{i}",
                "prompt_token_ids": prompt.tolist(),
                "response_token_ids": out[0, 5:].tolist(),
            }
            f.write(json.dumps(record) + "\n")
    return target_dir, path


def test_fit_then_eval_write_a_drafter_curves_and_an_evaluation(responses, tmp_path, capsys):
    from diffdraft.cli import main

    target_dir, data = responses
    common = ["--data", str(data), "--target", str(target_dir), "--held-out", "2"]
    out = tmp_path / "run"
    fit = [
        "train",
        "fit",
        *common,
        "--output-dir",
        str(out),
        "--num-layers",
        "1",
        "--block-size",
        "4",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--mask-token-id",
        "5",
        "--target-layer-ids",
        "0",
        "1",
        "--save-every",
        "2",
        "--draft-vocab-size",
        "100",
    ]
    assert main(fit) == 0
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "curves.png").is_file()
    printed = capsys.readouterr().out
    assert "training on 8 sequences (2 held out), 4 steps" in printed
    fastest = fastest_dtype("cpu")  # bfloat16 only where this CPU computes it natively
    assert f"precision: target {fastest}, drafter compute {fastest}" in printed
    assert "draft vocabulary: 100 tokens, 100.0% of training response tokens" in printed

    report = tmp_path / "eval.json"
    evaluate = [
        "train",
        "eval",
        *common,
        "--drafter",
        str(out / "final"),
        "--budgets",
        "4",
        "--max-new-tokens",
        "8",
        "--out",
        str(report),
    ]
    assert main(evaluate) == 0
    result = json.loads(report.read_text())
    assert len(result["accuracy_by_position"]) == 3
    assert set(result["tau"]) == {"chain", "ddtree-4"}
    assert all(t >= 1.0 for t in result["tau"].values())

    # fine-tuning starts from the given drafter, whose config (draft vocabulary too) carries over
    tuned = tmp_path / "tuned"
    base_fit = fit[: fit.index("--num-layers")]
    assert (
        main(
            [*base_fit, "--output-dir", str(tuned), "--batch-size", "2", "--init-drafter", str(out / "final")]
        )
        == 0
    )
    from diffdraft.drafters.checkpoint import load_draft_model

    assert load_draft_model(tuned / "final").draft_vocab.shape == (100,)

    curve = tmp_path / "curve.json"
    assert main([*evaluate[:-4], "--drafter", str(out), "--out", str(curve)]) == 0
    points = json.loads(curve.read_text())["learning_curve"]
    assert [p["checkpoint"] for p in points] == ["checkpoint-2", "checkpoint-4"]
    assert 0 < points[0]["tokens_seen"] < points[1]["tokens_seen"]
    assert curve.with_suffix(".png").is_file()

    # eval may hold out the whole file (held-out samples only), not more than it has
    whole = [
        "train",
        "eval",
        "--data",
        str(data),
        "--target",
        str(target_dir),
        "--drafter",
        str(out / "final"),
    ]
    whole += ["--budgets", "4", "--max-new-tokens", "4"]
    assert main([*whole, "--held-out", "10"]) == 0
    assert main([*whole, "--held-out", "11"]) != 0
    assert "eval needs between 1 and the 10 samples" in capsys.readouterr().err


def test_fit_stopped_by_its_time_limit_names_the_checkpoint_not_a_final_drafter(responses, tmp_path, capsys):
    from diffdraft.cli import main

    target_dir, data = responses
    out = tmp_path / "run"
    fit = ["train", "fit", "--data", str(data), "--target", str(target_dir), "--held-out", "2"]
    fit += ["--output-dir", str(out)]
    fit += ["--num-layers", "1", "--block-size", "4", "--batch-size", "2", "--epochs", "2"]
    fit += ["--mask-token-id", "5", "--target-layer-ids", "0", "1", "--max-minutes", "1e-9"]
    assert main(fit) == 0
    printed = capsys.readouterr().out
    assert not (out / "final").exists() and (out / "checkpoint-1").is_dir()
    assert "drafter written" not in printed
    assert f"no final drafter yet: step 1 of 8 is in {out / 'checkpoint-1'}; run the same command" in printed


def test_fit_seeds_a_dflash_from_a_dflare_only_when_asked(responses, tmp_path, capsys):
    from diffdraft.cli import main

    target_dir, data = responses
    fit = ["train", "fit", "--data", str(data), "--target", str(target_dir), "--held-out", "2"]
    fit += ["--batch-size", "2", "--epochs", "1"]
    dflare = tmp_path / "dflare"
    new = ["--num-layers", "1", "--block-size", "4", "--mask-token-id", "5", "--target-layer-ids", "0", "1"]
    assert main([*fit, "--output-dir", str(dflare), "--variant", "dflare", *new]) == 0
    assert main([*fit, "--output-dir", str(tmp_path / "tuned"), "--init-drafter", str(dflare / "final")]) == 0
    assert load_draft_model(tmp_path / "tuned" / "final").variant == "dflare"  # its own variant by default
    seeded = tmp_path / "seeded"
    assert (
        main(
            [
                *fit,
                "--output-dir",
                str(seeded),
                "--variant",
                "dflash",
                "--init-drafter",
                str(dflare / "final"),
            ]
        )
        == 0
    )
    drafter = load_draft_model(seeded / "final")
    assert drafter.variant == "dflash" and drafter.target_layer_ids == [0, 1] and drafter.mask_token_id == 5
    capsys.readouterr()
    assert (
        main(
            [
                *fit,
                "--output-dir",
                str(tmp_path / "x"),
                "--variant",
                "dart",
                "--init-drafter",
                str(dflare / "final"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "is a dflare drafter and cannot start a dart one (only a DFlare can seed a DFlash)" in err
    assert not (tmp_path / "x").exists()


def test_fit_and_eval_a_dart_drafter(responses, tmp_path, capsys):
    from diffdraft.cli import main
    from diffdraft.drafters.checkpoint import load_draft_model
    from diffdraft.drafters.dart_model import DARTDraftModel

    target_dir, data = responses
    common = ["--data", str(data), "--target", str(target_dir), "--held-out", "2"]
    out = tmp_path / "dart"
    fit = ["train", "fit", *common, "--output-dir", str(out), "--variant", "dart", "--draft-length", "3"]
    fit += ["--target-layer-ids", "0", "1", "1", "--batch-size", "2", "--epochs", "1", "--save-every", "2"]
    assert main(fit) == 0
    drafter = load_draft_model(out / "final")
    assert isinstance(drafter, DARTDraftModel) and drafter.max_depth == 4
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["gamma"] == 0.6
    report = tmp_path / "eval.json"
    evaluate = ["train", "eval", *common, "--drafter", str(out / "final"), "--budgets", "4"]
    assert main([*evaluate, "--max-new-tokens", "8", "--ngram", "none", "--out", str(report)]) == 0
    result = json.loads(report.read_text())
    assert len(result["accuracy_by_position"]) == 4
    assert set(result["tau"]) == {"chain", "ddtree-4", "dart-4"}


def test_fit_rejects_malformed_data_and_unwritable_output(responses, tmp_path, capsys):
    from diffdraft.cli import main

    target_dir, data = responses
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "prompt_token_ids": [1, 2]}\n')
    base = ["train", "fit", "--target", str(target_dir), "--mask-token-id", "5", "--held-out", "0"]
    assert main([*base, "--data", str(bad), "--output-dir", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1 is not a regenerated sample" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([*base, "--data", str(data), "--output-dir", str(blocker / "o"), "--batch-size", "2"]) == 2
    assert "cannot write to the output directory" in capsys.readouterr().err


def test_source_replies_become_responses_without_generating(tmp_path, capsys):
    target = make_checkpoint(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(target)
    source = tmp_path / "chats.jsonl"
    chats = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}],
        },
        {"id": "b", "messages": [{"role": "user", "content": "no answer here"}]},
    ]
    source.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "replies.jsonl"
    argv = ["train", "regenerate", "--source", str(source), "--target", str(target), "--out", str(out)]
    run_train(parse_train_args([*argv, "--source-replies"]))
    assert "1 samples written" in capsys.readouterr().out
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["id"] == "a:reply"
    assert record["prompt_token_ids"] == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.decode(record["response_token_ids"][:-1]) == "hello there"
    run_train(parse_train_args([*argv, "--source-replies"]))
    assert "0 samples written" in capsys.readouterr().out


def test_fit_fine_tunes_a_dflash2_drafter_as_dflash2(responses, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from diffdraft.cli import main

    target_dir, data = responses
    drafter = tmp_path / "dflash2"
    save_draft_model(tiny_dflash2(AutoModelForCausalLM.from_pretrained(target_dir)).float(), drafter)
    fit = ["train", "fit", "--data", str(data), "--target", str(target_dir), "--held-out", "0"]
    tuned = tmp_path / "tuned"
    assert main([*fit, "--output-dir", str(tuned), "--init-drafter", str(drafter), "--max-steps", "1"]) == 0
    assert load_draft_model(tuned / "final").variant == "dflash2"


def test_fit_refuses_to_start_from_a_drafter_it_drafts_with_only(responses, tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from diffdraft.cli import main
    from diffdraft.drafters import families

    monkeypatch.setitem(families.FAMILIES, "dflash2", replace(families.DFLASH2_FAMILY, trains=False))
    target_dir, data = responses
    drafter = tmp_path / "dflash2"
    save_draft_model(tiny_dflash2(AutoModelForCausalLM.from_pretrained(target_dir)).float(), drafter)
    fit = ["train", "fit", "--data", str(data), "--target", str(target_dir), "--held-out", "0"]
    assert main([*fit, "--output-dir", str(tmp_path / "tuned"), "--init-drafter", str(drafter)]) == 2
    assert "is a DFlash2 drafter, which diffdraft drafts with but does not train" in capsys.readouterr().err


def test_fit_refuses_a_deer_drafter_built_with_another_tokenizer(responses, tmp_path, capsys):
    from diffdraft.cli import main

    target_dir, data = responses
    drafter = tmp_path / "deer"
    init = ["deer", "init", "--from", str(target_dir), "--out", str(drafter), "--num-layers", "1"]
    assert main([*init, "--mask-token-id", "7"]) == 0
    config_path = drafter / "config.json"
    config = json.loads(config_path.read_text())
    config["deer_config"]["tokenizer_fingerprint"] = "another-tokenizer"
    config_path.write_text(json.dumps(config))
    fit = ["train", "fit", "--data", str(data), "--target", str(target_dir), "--held-out", "0"]
    out = tmp_path / "tuned"
    assert main([*fit, "--output-dir", str(out), "--variant", "deer", "--init-drafter", str(drafter)]) == 2
    assert "built with tokenizer another-tokenizer" in capsys.readouterr().err
    assert not (out / "final").exists()


def _token_data(path, rows):
    """A responses file of the given (prompt, response) token id lists."""
    lines = [
        json.dumps({"id": f"r{i}", "prompt_token_ids": prompt, "response_token_ids": response})
        for i, (prompt, response) in enumerate(rows)
    ]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_deer_fit_masks_with_an_unused_row_and_refuses_data_containing_the_mask(tmp_path, capsys):
    from diffdraft.cli import main

    target = make_checkpoint(tmp_path / "target")  # more embedding rows than tokens
    tokens = len(AutoTokenizer.from_pretrained(target))
    clean = _token_data(tmp_path / "clean.jsonl", [([3, 4, 5], [6 + i, 7, 8, 9, 10]) for i in range(4)])
    fit = ["train", "fit", "--target", str(target), "--held-out", "0", "--variant", "deer"]
    fit += ["--labels", "tokens", "--num-layers", "1", "--block-size", "4", "--batch-size", "2"]
    fit += ["--max-steps", "1"]
    assert main([*fit, "--data", str(clean), "--output-dir", str(tmp_path / "run")]) == 0
    picked = f"mask token: {tokens} (an unused embedding row: the embedding has {CHECKPOINT_VOCAB} rows"
    assert picked in capsys.readouterr().out
    assert load_draft_model(tmp_path / "run" / "final").mask_token_id == tokens

    # an id the data contains: given, or carried by a drafter to fine-tune, it is refused before training
    rows = [([3, 4, 5], [6, 7, 8, 9, 10]), ([3, 4, 5], [6, 7, 8, 9, 11]), ([7, 4], [5, 7, 8, 9, 10])]
    dirty = _token_data(tmp_path / "dirty.jsonl", rows)
    drafter = tmp_path / "deer"
    init = ["deer", "init", "--from", str(target), "--out", str(drafter), "--num-layers", "1"]
    assert main([*init, "--mask-token-id", "11"]) == 0
    capsys.readouterr()
    for flags, fix in (
        (["--mask-token-id", "7"], "the mask token id 7 occurs in 3 training samples (first: r0)"),
        (["--init-drafter", str(drafter)], "the mask token id 11 occurs in 1 training samples (first: r1)"),
    ):
        out = tmp_path / f"refused-{flags[0]}"
        assert main([*fit, "--data", str(dirty), "--output-dir", str(out), *flags]) == 2
        error = capsys.readouterr().err
        assert fix in error and "--mask-token-id" in error
        assert not out.exists()


@pytest.mark.parametrize(
    ("device", "gpus", "local_processes", "backend"),
    [
        ("cpu", 0, 2, "gloo"),
        ("cuda", 1, 1, "nccl"),
        ("cuda", 8, 8, "nccl"),
        ("cuda", 1, 4, "gloo"),  # four trainers sharing one GPU: NCCL would refuse the second rank
        ("cuda", 2, 4, "gloo"),
    ],
)
def test_process_group_backend_needs_a_gpu_per_process_for_nccl(device, gpus, local_processes, backend):
    assert process_group_backend(torch.device(device), gpus, local_processes) == backend


def test_eval_of_a_run_refuses_a_state_that_would_run_code_and_evaluates_once_it_is_deleted(
    responses, tmp_path, capsys
):
    from diffdraft.cli import main

    target_dir, data = responses
    common = ["--data", str(data), "--target", str(target_dir), "--held-out", "2"]
    run, marker = tmp_path / "run", tmp_path / "ran"
    fit = ["train", "fit", *common, "--output-dir", str(run), "--num-layers", "1", "--block-size", "4"]
    fit += ["--batch-size", "2", "--max-steps", "4", "--mask-token-id", "5", "--save-every", "2"]
    assert main(fit) == 0
    torch.save({"state": RunsCode(marker)}, run / "checkpoint-2" / "training_state.pt")
    evaluate = ["train", "eval", *common, "--drafter", str(run), "--budgets", "4", "--max-new-tokens", "4"]
    capsys.readouterr()
    assert main(evaluate) == 2
    captured = capsys.readouterr()
    assert not marker.exists()
    assert f"{run / 'checkpoint-2' / 'training_state.pt'} holds Python objects" in captured.err
    assert "learning curve" not in captured.out  # refused before any evaluation
    shutil.rmtree(run / "checkpoint-2")  # as the error says
    assert main([*evaluate, "--out", str(tmp_path / "curve.json")]) == 0
    points = json.loads((tmp_path / "curve.json").read_text())["learning_curve"]
    assert [p["checkpoint"] for p in points] == ["checkpoint-4"] and points[0]["tokens_seen"] > 0
