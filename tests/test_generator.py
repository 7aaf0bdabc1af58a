"""The Python API end to end on a tiny saved checkpoint: methods, streaming, stops, bad requests."""

from __future__ import annotations

import json

import pytest
import torch

import diffdraft
from diffdraft.bench.lossless import TIE_TOLERANCE, LosslessChecker
from diffdraft.budget import cost
from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.planner import BudgetPlanner, rounds_of
from diffdraft.decoding.method_table import METHODS
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.deer_model import deer_from_causal_lm
from diffdraft.target.loading import load_target
from diffdraft.util.fingerprint import tokenizer_fingerprint

from diffdraft_testing.checkpoints import make_checkpoint, save_tiny_drafter
from diffdraft_testing.drafters import tiny_dart, tiny_drafter
from diffdraft_testing.targets import hf_greedy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("target"), "qwen3")
    return path


@pytest.fixture(scope="module")
def drafter_dir(checkpoint, tmp_path_factory):
    return save_tiny_drafter(checkpoint, tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize(("method", "budget"), [("ar", 1), ("pld", 1), ("chain", 1), ("ddtree", 8)])
def test_every_method_gives_the_same_greedy_text(checkpoint, drafter_dir, method, budget):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method=method, budget=budget)
    result = generator.generate("hello world, the quick", max_new_tokens=20, ignore_eos=True)
    reference = hf_greedy(generator.loaded.model, result.prompt_token_ids, 20, eos=None)
    assert result.token_ids == reference[: len(result.token_ids)]
    assert len(result.token_ids) == 20
    assert result.text == generator.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.stats.rounds == len(result.stats.acceptance_lengths) > 0
    assert set(result.stats.timings) == {"prefill", "draft", "tree", "mask", "verify", "accept", "commit"}
    assert len(result.stats.tree_sizes) == len(result.stats.draft_depths) == result.stats.rounds
    fields = result.to_dict()
    assert {"prompt_token_ids", "token_ids", "text", "tau", "rounds", "timings"} <= set(fields)


def test_stream_yields_the_text_in_pieces_and_ends_with_the_result(checkpoint):
    generator = diffdraft.load(checkpoint, method="pld")
    chunks = list(generator.stream(prompt="hello world", max_new_tokens=12, ignore_eos=True))
    assert chunks[-1].result is not None
    assert "".join(c.text for c in chunks) == chunks[-1].result.text
    assert sum(len(c.token_ids) for c in chunks) == 12


def test_stop_string_cuts_text_and_keeps_tokens_through_the_stop(checkpoint):
    generator = diffdraft.load(checkpoint, method="ar")
    full = generator.generate("hello world", max_new_tokens=24, ignore_eos=True)
    assert len(full.text) > 4
    stop = full.text[3:5]
    result = generator.generate("hello world", max_new_tokens=24, ignore_eos=True, stop=[stop])
    assert result.stats.stop_reason == "stop_string"
    assert result.text == full.text[: full.text.find(stop)]
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    decoded = generator.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert stop in decoded
    assert stop not in generator.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)


def test_sampling_with_a_seed_is_reproducible_and_methods_agree_on_lengths(checkpoint, drafter_dir):
    chain = diffdraft.load(checkpoint, drafter=drafter_dir, method="chain")
    options = dict(prompt="hello", max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert chain.generate(**options).token_ids == chain.generate(**options).token_ids


@pytest.mark.parametrize("method", ["ar", "ddtree+pld"])
def test_generate_batch_gives_each_request_its_alone_result(checkpoint, drafter_dir, method):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method=method, budget=6)
    requests = [
        "hello world",
        diffdraft.GenerationRequest("the quick brown", max_new_tokens=5, ignore_eos=True),
        diffdraft.GenerationRequest("fox", max_new_tokens=14, temperature=0.9, seed=3, ignore_eos=True),
        diffdraft.GenerationRequest(messages=None, prompt="world hello", max_new_tokens=9, stop=["o"]),
        diffdraft.GenerationRequest(
            "hello", max_new_tokens=12, temperature=1.0, top_p=0.8, seed=11, ignore_eos=True
        ),
    ]
    expected = [
        generator.generate(r) if isinstance(r, str) else generator.generate(**vars(r)) for r in requests
    ]
    results = generator.generate_batch(requests, max_batch_size=3)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]
    assert [r.stats.stop_reason for r in results] == [e.stats.stop_reason for e in expected]
    with pytest.raises(diffdraft.InvalidRequestError, match="max_batch_size must be >= 1"):
        generator.generate_batch(requests, max_batch_size=0)
    with pytest.raises(diffdraft.InvalidRequestError, match="temperature must be >= 0"):
        generator.generate_batch(["hello", diffdraft.GenerationRequest("hi", temperature=-1.0)])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(temperature=0.5, seed=2**70), r"seed must be an integer in \[-9223372036854775808, "),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(stop=[""]), "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_and_stop_parameters_are_clear_errors(checkpoint, options, message):
    generator = diffdraft.load(checkpoint)
    with pytest.raises(diffdraft.InvalidRequestError, match=message):
        generator.generate("hello", **options)


def test_prompt_longer_than_the_context_is_a_clear_error(checkpoint):
    generator = diffdraft.load(checkpoint)
    too_long = list(range(3, 3 + generator.target.max_context))
    with pytest.raises(diffdraft.InvalidRequestError, match="context holds 128"):
        generator.generate(prompt_token_ids=too_long)


def test_requests_must_name_exactly_one_input(checkpoint):
    generator = diffdraft.load(checkpoint)
    with pytest.raises(diffdraft.InvalidRequestError, match="exactly one"):
        generator.generate("hi", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(diffdraft.InvalidRequestError, match="prompt_token_ids"):
        generator.generate(prompt_token_ids=[10**6])


@pytest.mark.parametrize(
    ("method", "drafter", "message"),
    [
        ("chain", None, "needs a drafter"),
        ("dart", "none", "needs a drafter"),
        ("deer-tree", None, "DFlash/DFlare, DART, DEER, DFlash2 or DSpark checkpoint"),
        ("beam", None, "unknown method"),
    ],
)
def test_methods_without_what_they_need_are_clear_errors(checkpoint, method, drafter, message):
    with pytest.raises(diffdraft.InvalidRequestError, match=message):
        diffdraft.load(checkpoint, drafter=drafter, method=method)


def test_a_missing_default_drafter_is_a_clear_error(checkpoint, tmp_path, monkeypatch):
    import diffdraft.drafters.checkpoint

    monkeypatch.setattr(diffdraft.drafters.checkpoint, "DEFAULT_DRAFTER_DIR", tmp_path / "gone")
    with pytest.raises(diffdraft.CheckpointError, match="default drafter is missing"):
        diffdraft.load(checkpoint, drafter="default", method="ddtree")


def test_ddtree_budget_below_one_is_rejected(checkpoint, drafter_dir):
    with pytest.raises(diffdraft.InvalidRequestError, match="budget"):
        diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=0)


def test_drafter_for_another_target_is_rejected(checkpoint, tmp_path):
    other = make_checkpoint(tmp_path / "other", "llama")
    target = diffdraft.load(other).loaded.model
    config = target.config
    config.hidden_size = 48
    bigger = type(target)(config)
    save_draft_model(tiny_drafter(bigger).float(), tmp_path / "drafter")
    with pytest.raises(diffdraft.IncompatibleDrafterError, match="hidden size 48"):
        diffdraft.load(checkpoint, drafter=tmp_path / "drafter", method="chain")


@pytest.fixture(scope="module")
def dart_and_trie(checkpoint, tmp_path_factory):
    """A random DART drafter for the tiny target and a 3-gram trie built with the target's tokenizer."""
    from diffdraft.ngram.build import build_from_sources

    loaded = diffdraft.load(checkpoint).loaded
    root = tmp_path_factory.mktemp("dart")
    save_draft_model(tiny_dart(loaded.model, draft_length=4).float(), root / "dart")
    corpus = root / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"prompt": t}) + "\n" for t in ["hello world, the quick", "the quick brown fox"])
    )
    build_from_sources(
        loaded.tokenizer, [str(corpus)], root / "trie", min_count=1, decontaminate=False, progress=False
    )
    return root / "dart", root / "trie"


@pytest.mark.parametrize(("method", "ngram"), [("dart", True), ("dart", False), ("ddtree", False)])
def test_dart_drafter_and_tree_give_the_same_greedy_text(checkpoint, dart_and_trie, method, ngram):
    dart, trie = dart_and_trie
    generator = diffdraft.load(
        checkpoint, drafter=dart, method=method, budget=12, ngram=trie if ngram else None
    )
    result = generator.generate("hello world, the quick", max_new_tokens=20, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 20, eos=None)
    assert max(result.stats.tree_sizes) <= 12


def test_dart_tree_over_a_dflash_drafter_is_lossless(checkpoint, drafter_dir, dart_and_trie):
    generator = diffdraft.load(
        checkpoint, drafter=drafter_dir, method="dart", budget=8, ngram=dart_and_trie[1]
    )
    result = generator.generate("the quick brown", max_new_tokens=16, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 16, eos=None)


def test_a_trie_of_another_tokenizer_or_an_auto_dart_budget_is_refused(checkpoint, dart_and_trie, tmp_path):
    import shutil

    dart, trie = dart_and_trie
    other = tmp_path / "other-trie"
    shutil.copytree(trie, other)
    meta = json.loads((other / "ngram.json").read_text())
    meta["tokenizer_hash"] = "sha256:0000000000000000"
    (other / "ngram.json").write_text(json.dumps(meta))
    with pytest.raises(diffdraft.IncompatibleDrafterError, match="rebuild it for this target"):
        diffdraft.load(checkpoint, drafter=dart, method="dart", ngram=other)
    with pytest.raises(diffdraft.InvalidRequestError, match="tree size"):
        diffdraft.load(checkpoint, drafter=dart, method="dart", budget="auto")
    with pytest.raises(diffdraft.CheckpointError, match="N-gram trie"):
        diffdraft.load(checkpoint, drafter=dart, method="dart", ngram=tmp_path / "nowhere")


@pytest.fixture(scope="module")
def deer_dir(checkpoint, tmp_path_factory):
    """A DEER drafter cut from the tiny target's first layer, recording the target's tokenizer."""
    loaded = diffdraft.load(checkpoint).loaded
    path = tmp_path_factory.mktemp("deer")
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    save_draft_model(deer_from_causal_lm(loaded.model, 1, 4, 0, fingerprint, "the tiny target"), path)
    return path


@pytest.mark.parametrize(
    ("method", "max_nodes"), [("deer", 4), ("deer-tree", 6), ("chain", 4), ("ddtree", 6), ("dart", 6)]
)
def test_deer_methods_and_any_tree_over_a_deer_drafter_give_the_same_greedy_text(
    checkpoint, deer_dir, method, max_nodes
):
    """Chains draft the whole block (4 tokens); trees keep to the budget (6 nodes)."""
    generator = diffdraft.load(checkpoint, drafter=deer_dir, method=method, budget=6)
    result = generator.generate("hello world, the quick", max_new_tokens=20, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 20, eos=None)
    assert max(result.stats.draft_depths) == 4  # the DEER drafter drafted its whole block
    assert max(result.stats.tree_sizes) == max_nodes


def test_deer_sampling_with_a_seed_is_reproducible(checkpoint, deer_dir):
    generator = diffdraft.load(checkpoint, drafter=deer_dir, method="deer")
    options = dict(prompt="hello", max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert generator.generate(**options).token_ids == generator.generate(**options).token_ids


def test_deer_tree_takes_an_auto_budget(checkpoint, deer_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    generator = diffdraft.load(checkpoint, drafter=deer_dir, method="deer-tree", budget="auto")
    assert isinstance(generator.engine.builder, AutoBudgetBuilder)
    result = generator.generate("hello world", max_new_tokens=12, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 12, eos=None)


@pytest.mark.parametrize("method", ["deer", "deer-tree"])
def test_deer_methods_refuse_other_drafter_families(checkpoint, drafter_dir, dart_and_trie, method):
    for other in (drafter_dir, dart_and_trie[0]):
        with pytest.raises(diffdraft.InvalidRequestError, match=f"method '{method}' needs a DEER drafter"):
            diffdraft.load(checkpoint, drafter=other, method=method)


def test_a_deer_drafter_of_another_tokenizer_is_refused(checkpoint, tmp_path):
    loaded = diffdraft.load(checkpoint).loaded
    loaded.tokenizer.add_tokens(["<not-in-the-target's-tokenizer>"])  # this load's only
    fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    save_draft_model(deer_from_causal_lm(loaded.model, 1, 4, 0, fingerprint, "elsewhere"), tmp_path)
    with pytest.raises(diffdraft.IncompatibleDrafterError, match="built with tokenizer"):
        diffdraft.load(checkpoint, drafter=tmp_path, method="deer")


def test_the_generator_is_reusable_across_requests(checkpoint, drafter_dir):
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=4)
    first = generator.generate("hello world", max_new_tokens=10, ignore_eos=True)
    generator.generate("the quick brown fox", max_new_tokens=10, ignore_eos=True)
    again = generator.generate("hello world", max_new_tokens=10, ignore_eos=True)
    assert first.token_ids == again.token_ids
    assert torch.is_tensor(torch.tensor(first.token_ids))


@pytest.mark.real_model
def test_default_target_every_method_matches_transformers_greedy(tmp_path):
    """Token for token, but for a divergence where the top two logits tie within the rounding of the
    default load's dtype (bfloat16 on CPUs that compute it: transformers' own cached and uncached
    forwards then disagree too), checked in float32 as the benchmark checks it."""
    generator = diffdraft.load("default", method="pld")
    model = generator.loaded.model
    checker = LosslessChecker(
        lambda: load_target("default", dtype="float32", optimize=False).model, TIE_TOLERANCE[model.dtype]
    )
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    expected = None
    save_draft_model(tiny_drafter(model, layers=1, block_size=6).float(), tmp_path / "drafter")
    for method in ("ar", "pld", "chain", "ddtree"):
        gen = diffdraft.SpeculativeGenerator(generator.loaded, method, tmp_path / "drafter", budget=16)
        result = gen.generate(messages=messages, max_new_tokens=24)
        if expected is None:
            expected = hf_greedy(model, result.prompt_token_ids, 24, eos=gen.end_token_ids)
        divergence = checker.check(result.prompt_token_ids, expected, result.token_ids)
        assert divergence is None or divergence.explained, (method, divergence)


@pytest.fixture
def auto_generator(checkpoint, drafter_dir, monkeypatch, tmp_path) -> diffdraft.SpeculativeGenerator:
    """ddtree with the auto budget, its cost curve measured at a few small points into tmp_path."""
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8, 16))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    return diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget="auto")


def test_ddtree_auto_budget_is_lossless_and_learns_from_each_request(auto_generator, tmp_path):
    generator = auto_generator
    result = generator.generate("hello world, the quick", max_new_tokens=16, ignore_eos=True)
    reference = hf_greedy(generator.loaded.model, result.prompt_token_ids, 16, eos=None)
    assert result.token_ids == reference[:16]
    assert list(tmp_path.glob("verify_cost/*.json"))  # the measured curve is cached
    learned = generator.engine.builder.planner.rank_gains()[1]
    assert learned[0] == sum(nodes >= 1 for nodes in result.stats.tree_sizes) > 0  # after the request
    assert result.stats.budgets and len(result.stats.verify_contexts) == result.stats.rounds


def test_ddtree_auto_budget_in_a_batch_learns_from_each_finished_request_alone(auto_generator):
    generator = auto_generator
    requests = [
        diffdraft.GenerationRequest(prompt, max_new_tokens=n, ignore_eos=True)
        for prompt, n in [("hello world, the quick", 24), ("def f(x):", 12), ("one two three", 18)]
    ]
    results = generator.generate_batch(requests, max_batch_size=3)
    for request, result in zip(requests, results, strict=True):
        reference = hf_greedy(
            generator.loaded.model, result.prompt_token_ids, request.max_new_tokens, eos=None
        )
        assert result.token_ids == reference[: request.max_new_tokens]
    planner = generator.engine.builder.planner
    each = BudgetPlanner(planner.curve)
    for result in results:
        each.observe_rounds(rounds_of(result.stats))
    for learned, expected in zip(planner.rank_gains(), each.rank_gains(), strict=True):
        assert learned.tolist() == expected.tolist()


def test_only_an_auto_budgets_lookup_boost_remembers_its_copies_across_requests(
    checkpoint, drafter_dir, monkeypatch, tmp_path
):
    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8, 16))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    auto = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree+pld", budget="auto")
    fixed = diffdraft.SpeculativeGenerator(auto.loaded, "ddtree+pld", drafter_dir, budget=4)
    assert fixed.drafter.calibration.record is None  # a seeded request's output never depends on earlier ones
    assert auto.drafter.calibration.record is not None
    assert (
        auto.drafter.fork().calibration.record is auto.drafter.calibration.record
    )  # a batch's sequences add to the one record


def test_cli_accepts_an_auto_budget(checkpoint, drafter_dir, monkeypatch, tmp_path, capsys):
    from diffdraft.cli import main

    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    args = [
        "generate",
        "--target",
        str(checkpoint),
        "--drafter",
        str(drafter_dir),
        "--method",
        "ddtree",
        "--budget",
        "auto",
        "--prompt",
        "hello",
        "--max-new-tokens",
        "6",
        "--json",
    ]
    assert main(args) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1


@pytest.mark.real_model
def test_the_shipped_default_drafter_is_lossless_and_gets_accepted():
    loaded = diffdraft.load("default").loaded  # dtype "auto": bf16 on the int8 kernels where they run
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    # lossless = our own plain decoding on the same weights and kernels
    expected = diffdraft.SpeculativeGenerator(loaded, "ar").generate(messages=messages, max_new_tokens=32)
    # an untrained drafter gets tau ~1.0; these floors sit well under what the shipped one measures
    for method, floor in (("chain", 1.05), ("ddtree", 1.2), ("ddtree+pld", 1.2)):
        gen = diffdraft.SpeculativeGenerator(loaded, method, "default", budget=32)
        result = gen.generate(messages=messages, max_new_tokens=32)
        assert result.token_ids == expected.token_ids, method
        assert result.stats.tau > floor, (method, result.stats.acceptance_histogram)


@pytest.mark.real_model
def test_dart_on_the_default_target_matches_transformers_greedy_on_humaneval(tmp_path):
    """Five HumanEval prompts in float32: DART's drafter and N-gram-pruned tree change no token."""
    from diffdraft.bench.datasets import load_samples
    from diffdraft.drafters.checkpoint import DEFAULT_DART_DIR
    from diffdraft.ngram.build import build_from_sources

    loaded = diffdraft.load("default", method="ar", dtype="float32").loaded
    texts = ["def add(a, b):\n    return a + b", "for i in range(10):\n    print(i)", "import numpy as np"]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    trie = tmp_path / "trie"
    build_from_sources(loaded.tokenizer, [str(tmp_path / "corpus.jsonl")], trie, min_count=1, progress=False)
    drafter = "default-dart" if (DEFAULT_DART_DIR / "config.json").is_file() else None
    if drafter is None:  # no shipped DART drafter: a random one still exercises every path
        drafter = tmp_path / "dart"
        save_draft_model(tiny_dart(loaded.model, draft_length=7, init_std=0.02).float(), drafter)
    gen = diffdraft.SpeculativeGenerator(loaded, "dart", drafter, budget=32, ngram=trie)
    taus = []
    for sample in load_samples("humaneval", 5):
        result = gen.generate(messages=sample.messages, max_new_tokens=24)
        expected = hf_greedy(loaded.model, result.prompt_token_ids, 24, eos=gen.end_token_ids)
        assert result.token_ids == expected, sample.id
        taus.append(result.stats.tau)
    if drafter == "default-dart":  # an untrained drafter gets tau ~1.0; the shipped v0 measured 1.6 here
        assert sum(taus) / len(taus) > 1.3, taus


@pytest.mark.real_model
def test_deer_on_the_default_target_matches_transformers_greedy(tmp_path):
    """DEER's chain and DDTree over it change no token of the default target (float32)."""
    from diffdraft.bench.datasets import load_samples
    from diffdraft.drafters.checkpoint import DEFAULT_DEER_DIR

    loaded = diffdraft.load("default", method="ar", dtype="float32").loaded
    drafter = "default-deer" if (DEFAULT_DEER_DIR / "config.json").is_file() else None
    if drafter is None:  # no shipped DEER drafter yet: an untrained one still exercises every path
        drafter = tmp_path / "deer"
        fingerprint = tokenizer_fingerprint(loaded.tokenizer)
        save_draft_model(deer_from_causal_lm(loaded.model, 2, 8, 0, fingerprint, "default target"), drafter)
    generators = {
        m: diffdraft.SpeculativeGenerator(loaded, m, drafter, budget=16) for m in ("deer", "deer-tree")
    }
    taus = {method: [] for method in generators}
    for sample in load_samples("humaneval", 5):
        expected = None
        for method, gen in generators.items():
            result = gen.generate(messages=sample.messages, max_new_tokens=24)
            if expected is None:
                expected = hf_greedy(loaded.model, result.prompt_token_ids, 24, eos=gen.end_token_ids)
            assert result.token_ids == expected, (method, sample.id)
            taus[method].append(result.stats.tau)
    if drafter == "default-deer":  # an untrained drafter gets tau ~1.0
        assert sum(taus["deer-tree"]) / 5 > 1.15, taus


@pytest.mark.real_model
def test_a_batch_on_the_default_target_gives_every_request_its_alone_tokens():
    """Four HumanEval prompts in float32, three at a time with the shipped drafter: each output is the
    one the request gets alone (greedy) or with its own seed (sampled)."""
    from diffdraft.bench.datasets import load_samples

    loaded = diffdraft.load("default", method="ar", dtype="float32").loaded
    gen = diffdraft.SpeculativeGenerator(loaded, "ddtree+pld", "default", budget=8)
    requests = [
        diffdraft.GenerationRequest(messages=sample.messages, max_new_tokens=20 + 4 * i, seed=i)
        for i, sample in enumerate(load_samples("humaneval", 4))
    ]
    requests[3].temperature = 0.8
    alone = [gen.generate(**vars(request)).token_ids for request in requests]
    assert [r.token_ids for r in gen.generate_batch(requests, max_batch_size=3)] == alone


def test_without_a_budget_ddtree_methods_plan_it_and_dart_takes_its_default_size(
    checkpoint, drafter_dir, dart_and_trie, monkeypatch, tmp_path, capsys
):

    monkeypatch.setenv("DIFFDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(cost, "PROBE_SIZES", (1, 4, 8))
    monkeypatch.setattr(cost, "PROBE_CONTEXTS", (16, 32))
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree")
    assert isinstance(generator.engine.builder, AutoBudgetBuilder)
    assert "timing a few verification forwards of this target" in capsys.readouterr().err  # said
    drafter, trie = dart_and_trie
    dart = diffdraft.load(checkpoint, drafter=drafter, method="dart", ngram=trie)
    assert dart.engine.builder.settings.tree_size == METHODS["dart"].default_budget == 32


@pytest.mark.parametrize(
    ("request_options", "message"),
    [
        (dict(prompt="hello \udcff"), "prompt is not valid UTF-8 text"),
        (dict(messages=[{"role": "user", "content": "hi \ud800"}]), r"messages\[0\]\[.content.\] is not"),
        (dict(prompt="hello", temperature=1e-300), "temperature 1e-300 is too small to sample with"),
        (dict(prompt="hello", temperature=float("inf")), "temperature must be finite"),
        (dict(prompt="hello", temperature=float("nan")), "temperature must be a number"),
        (dict(prompt="hello", temperature=1.0, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    ],
)
def test_a_faulty_request_is_a_clear_error_and_the_generator_serves_the_next_exactly(
    checkpoint, request_options, message
):
    generator = diffdraft.load(checkpoint, method="pld")
    with pytest.raises(diffdraft.InvalidRequestError, match=message):
        generator.generate(max_new_tokens=6, **request_options)
    result = generator.generate("hello world", max_new_tokens=6, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 6, eos=None)


def test_a_budget_above_the_tree_bound_is_refused_and_the_bound_itself_decodes_exactly(
    checkpoint, drafter_dir, dart_and_trie
):
    with pytest.raises(diffdraft.InvalidRequestError, match="ddtree budget must be at most 4096 nodes"):
        diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=10**9)
    with pytest.raises(diffdraft.InvalidRequestError, match="tree_size must be at most 4096 nodes"):
        diffdraft.load(checkpoint, drafter=dart_and_trie[0], method="dart", budget=10**9)
    generator = diffdraft.load(checkpoint, drafter=drafter_dir, method="ddtree", budget=4096)
    result = generator.generate("hello world", max_new_tokens=6, ignore_eos=True)
    assert result.token_ids == hf_greedy(generator.loaded.model, result.prompt_token_ids, 6, eos=None)
