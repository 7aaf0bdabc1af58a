"""The method registry and its runners on a tiny saved checkpoint: same tokens, honest accounting."""

from __future__ import annotations

from pathlib import Path

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
from diffdraft.budget.batch_cost import BatchCostCurve
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.errors import InvalidRequestError
from diffdraft.generator import GenerationRequest
from diffdraft.target.loading import load_target

from diffdraft_testing.checkpoints import make_checkpoint, save_dart_and_trie, save_deer
from diffdraft_testing.drafters import tiny_drafter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")


@pytest.fixture(scope="module")
def drafters(checkpoint, tmp_path_factory):
    """(DFlash drafter, DART drafter, N-gram trie, DEER drafter) directories for the tiny target."""
    root = tmp_path_factory.mktemp("drafters")
    save_draft_model(tiny_drafter(load_target(checkpoint).model, block_size=4).float(), root / "dflash")
    return root / "dflash", *save_dart_and_trie(checkpoint, root), save_deer(checkpoint, root / "deer")


@pytest.fixture(scope="module")
def models(checkpoint, drafters, tmp_path_factory):
    drafter, dart, trie, deer = drafters
    return BenchModels(
        checkpoint,
        drafter=drafter,
        assistant=checkpoint,
        cost_cache=tmp_path_factory.mktemp("c"),
        dart_drafter=dart,
        ngram=trie,
        deer_drafter=deer,
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
        "llama.cpp",
        "llama.cpp:bf16",
        "llama.cpp-pld",
        "pld",
        "chain",
        "ddtree:8",
        "ddtree:auto",
        "chain+pld",
        "ddtree+pld:32",
        "dart:59",
        "dart-no-ngram:59",
        "ddtree-dart:59",
        "dart-tree:59",
        "deer",
        "deer-tree:32",
        "mine",
    ]


@pytest.mark.parametrize(
    "label",
    [
        "hf",
        "hf-pld:2",
        "hf-assisted",
        "pld",
        "chain",
        "ddtree:4",
        "ddtree:auto",
        "ar@bfloat16",
        "dart",
        "dart:8",
        "dart-no-ngram:8",
        "ddtree-dart:4",
        "dart-tree:8",
        "deer",
        "deer-tree:4",
        "deer-tree:auto",
    ],
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
    if label.endswith(":auto"):
        assert done.budgets and all(b >= 1 for b in done.budgets)
        # the generator fed this generation to the bench's planner, once
        assert runner.auto.planner.rank_gains()[1][0] == sum(size > 1 for size in done.verify_sizes)
    if label.startswith("deer"):  # the DEER drafter's forward is timed as drafting, its block drafted
        assert done.stages["draft"] > 0 and max(done.draft_depths) == 4


def test_the_bench_plans_batches_of_auto_methods_with_the_batch_cost_curve(models):
    """What users run: the generator's auto budget plans shared forwards with the batch curve (the
    bench's had none, and planned them with the single-sequence curve over all their tokens)."""
    runner = build_method(models, MethodSpec.parse("ddtree:auto"))
    prompt = models.tokenizer("hello world, the quick")["input_ids"]
    requests = [GenerationRequest(prompt_token_ids=prompt, max_new_tokens=6)] * 2
    runner.generator.generate_batch(requests, 2)
    assert isinstance(runner.auto.rounds.batch_cost, BatchCostCurve)
    assert runner.auto.rounds.batch_cost is models.batch_cost_curve()  # measured once, for every method
    assert list((Path(models.cost_cache) / "batch").glob("*.json"))  # cached beside the other curve


def test_methods_that_need_a_model_not_given_are_unavailable(checkpoint, drafters, tmp_path):
    bare = BenchModels(checkpoint, cost_cache=tmp_path, ngram=drafters[2])
    for label in (
        "chain",
        "ddtree:8",
        "hf-assisted",
        "dart",
        "dart-no-ngram:8",
        "ddtree-dart:4",
        "dart-tree:8",
        "deer",
        "deer-tree",
    ):
        with pytest.raises(MethodUnavailable):
            build_method(bare, MethodSpec.parse(label))
    assert bare._ngram is None  # the trie is loaded only for a dart method that can run
    only_dflash = BenchModels(checkpoint, cost_cache=tmp_path, drafter=drafters[0])
    with pytest.raises(MethodUnavailable, match="--dart-drafter"):
        build_method(only_dflash, MethodSpec.parse("dart:8"))
    with pytest.raises(MethodUnavailable, match="--deer-drafter"):
        build_method(only_dflash, MethodSpec.parse("deer-tree:8"))
    with pytest.raises(InvalidRequestError, match="unknown method 'nope'"):
        build_method(bare, MethodSpec("nope"))
    with pytest.raises(InvalidRequestError, match="positive integer"):
        build_method(bare, MethodSpec("hf-pld", "x"))


def test_dart_times_its_ngram_lookups_apart_from_the_tree(models):
    request = Request(models.tokenizer("hello world, the quick")["input_ids"], max_new_tokens=12)
    dart = build_method(models, MethodSpec.parse("dart:8"))
    assert build_method(models, MethodSpec.parse("dart-no-ngram:8")).lookups is None
    assert models.ngram() is dart.lookups.trie  # loaded once, shared
    assert build_method(models, MethodSpec.parse("dart-tree:8")).lookups.trie is dart.lookups.trie
    done = dart.generate(request)
    rounds = len(done.acceptance_lengths)
    # one lookup per beam entry per drafted level: at least one per round
    assert done.ngram_lookups >= rounds and done.stages["ngram"] > 0 and done.stages["tree"] >= 0
    assert 0 < done.ngram_lookup_median <= done.stages["ngram"]
    assert sum(done.stages.values()) <= done.seconds * 1.01
    again = dart.generate(request)
    assert again.ngram_lookups == done.ngram_lookups  # counted per generation, not cumulated
    for label in ("ar", "ddtree-dart:4", "dart-no-ngram:8", "deer-tree:4", "hf"):
        other = build_method(models, MethodSpec.parse(label)).generate(request)
        assert other.stages["ngram"] == 0.0 and other.ngram_lookups == 0


def test_a_dflash_checkpoint_is_not_taken_for_a_dart_drafter(checkpoint, drafters, tmp_path):
    mixed = BenchModels(checkpoint, cost_cache=tmp_path, dart_drafter=drafters[0])
    with pytest.raises(InvalidRequestError, match="not a DART one"):
        build_method(mixed, MethodSpec.parse("dart:8"))
    with pytest.raises(InvalidRequestError, match="auto budget"):
        build_method(BenchModels(checkpoint, dart_drafter=drafters[1]), MethodSpec.parse("dart:auto"))


def test_deer_methods_take_only_a_deer_drafter_and_skip_a_shipped_one_not_installed(
    checkpoint, drafters, tmp_path, monkeypatch
):
    dflash, dart, _, deer = drafters
    with pytest.raises(InvalidRequestError, match="not a DEER one; pass it as --drafter"):
        build_method(BenchModels(checkpoint, deer_drafter=dflash), MethodSpec.parse("deer"))
    with pytest.raises(InvalidRequestError, match="not a DEER one; pass it as --dart-drafter"):
        build_method(BenchModels(checkpoint, deer_drafter=dart), MethodSpec.parse("deer-tree:4"))
    with pytest.raises(InvalidRequestError, match="auto budget"):
        build_method(BenchModels(checkpoint, deer_drafter=deer), MethodSpec.parse("deer:auto"))
    import diffdraft.drafters.checkpoint

    monkeypatch.setattr(diffdraft.drafters.checkpoint, "DEFAULT_DEER_DIR", tmp_path / "not-shipped")
    with pytest.raises(MethodUnavailable, match="default-deer drafter is missing"):
        build_method(BenchModels(checkpoint, deer_drafter="default-deer"), MethodSpec.parse("deer"))


def test_methods_that_share_one_drafter_model_leave_each_other_nothing(models):
    """The bench builds every drafter method on one loaded draft model: what one runner drafts must
    not depend on what another drafted on it before (its cached context lives in its own drafter)."""
    first = models.tokenizer("hello world, the quick")["input_ids"]
    other = models.tokenizer("the brown fox, hello")["input_ids"]
    runner = build_method(models, MethodSpec.parse("ddtree:4"))
    alone = runner.generate(Request(first, max_new_tokens=16))
    neighbour = build_method(models, MethodSpec.parse("ddtree+pld:4"))
    assert runner.generator.drafter.model is neighbour.generator.drafter.drafter.model  # shared weights
    neighbour.generate(Request(other, max_new_tokens=16))
    again = runner.generate(Request(first, max_new_tokens=16))
    fresh = build_method(models, MethodSpec.parse("ddtree:4")).generate(Request(first, max_new_tokens=16))
    for done in (again, fresh):
        assert done.token_ids == alone.token_ids
        assert done.acceptance_lengths == alone.acceptance_lengths
        assert done.verify_sizes == alone.verify_sizes
