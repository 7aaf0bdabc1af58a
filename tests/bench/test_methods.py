"""The method registry and its runners on a tiny saved checkpoint: same tokens, honest accounting."""

from __future__ import annotations

import pytest

from diffdraft.bench import methods
from diffdraft.bench.methods import (
    STAGE_NAMES,
    BenchModels,
    MethodSpec,
    MethodUnavailable,
    Request,
    build_method,
    default_specs,
    register,
)
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.errors import InvalidRequestError
from diffdraft.loading import load_target

from conftest import make_checkpoint, tiny_drafter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    drafter = tmp_path_factory.mktemp("drafter")
    save_draft_model(tiny_drafter(load_target(checkpoint).model, block_size=4).float(), drafter)
    return BenchModels(
        checkpoint, drafter=drafter, assistant=checkpoint, cost_cache=tmp_path_factory.mktemp("c")
    )


def test_specs_parse_and_print_back():
    spec = MethodSpec.parse("ddtree:32@bfloat16")
    assert (spec.name, spec.arg, spec.dtype, spec.label) == ("ddtree", "32", "bfloat16", "ddtree:32@bfloat16")
    assert MethodSpec.parse("hf") == MethodSpec("hf")
    with pytest.raises(InvalidRequestError, match="name\\[:arg\\]\\[@dtype\\]"):
        MethodSpec.parse("hf@float8")


def test_default_specs_expand_budgets_and_pick_up_new_registrations(monkeypatch):
    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))
    register("mine", lambda models, spec: None)
    labels = [s.label for s in default_specs(["8", "auto"])]
    assert labels == [
        "ar",
        "hf",
        "hf-pld:3",
        "hf-pld:10",
        "hf-assisted",
        "pld",
        "chain",
        "ddtree:8",
        "ddtree:auto",
        "chain+pld",
        "ddtree+pld:32",
        "mine",
    ]


@pytest.mark.parametrize(
    "label", ["hf", "hf-pld:2", "hf-assisted", "pld", "chain", "ddtree:4", "ddtree:auto", "ar@bfloat16"]
)
def test_every_method_matches_plain_ar_and_accounts_for_its_time(models, label):
    request = Request(models.tokenizer("hello world, the quick")["input_ids"], max_new_tokens=12)
    reference = build_method(models, MethodSpec("ar")).generate(request)
    runner = build_method(models, MethodSpec.parse(label))
    done = runner.generate(request)
    if "@" not in label:  # another dtype rounds differently
        assert done.token_ids == reference.token_ids
    assert set(done.stages) == set(STAGE_NAMES)
    assert all(v >= 0 for v in done.stages.values())
    assert sum(done.stages.values()) <= done.seconds * 1.01
    rounds = len(done.acceptance_lengths)
    assert rounds and len(done.verify_sizes) == len(done.verify_seconds) == rounds
    assert sum(done.acceptance_lengths) >= len(done.token_ids) - 1
    if label == "ddtree:auto":
        assert done.budgets and all(b >= 1 for b in done.budgets)


def test_methods_that_need_a_model_not_given_are_unavailable(checkpoint, tmp_path):
    bare = BenchModels(checkpoint, cost_cache=tmp_path)
    for label in ("chain", "ddtree:8", "hf-assisted"):
        with pytest.raises(MethodUnavailable):
            build_method(bare, MethodSpec.parse(label))
    with pytest.raises(InvalidRequestError, match="unknown method 'nope'"):
        build_method(bare, MethodSpec("nope"))
    with pytest.raises(InvalidRequestError, match="positive integer"):
        build_method(bare, MethodSpec("hf-pld", "x"))
