"""The llama.cpp row's accounting, on a stand-in for llama-cpp-python that decodes a known sequence.

The real binding is an optional extra (it compiles llama.cpp), so these tests never need it: the
stand-in follows the binding's generate loop (one ``eval`` per prefill or round, rejected drafts
rolled back from ``n_tokens``) and the runner must count what it did.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from diffdraft.bench.llamacpp import LlamaCppRunner
from diffdraft.bench.methods import STAGE_NAMES, MethodSpec, MethodUnavailable, Request, build_method


def successor(token: int) -> int:
    return (token * 7 + 3) % 97


class StandInLookup:
    """Drafts the next two tokens right and a third wrong, so every round commits three."""

    def __init__(self, num_pred_tokens: int) -> None:
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, last: int) -> list[int]:
        first = successor(last)
        return [first, successor(first), successor(successor(first)) + 1]


class StandInLlama:
    def __init__(self, model_path: str, draft_model: StandInLookup | None = None, **options) -> None:
        self.model_path, self.draft, self.options = model_path, draft_model, options
        self.n_tokens = 0
        self.seed: int | None = None
        self.cached: list[int] = []
        self.prefills: list[int] = []
        """Prompt tokens each generation evaluated: like the binding, a prompt whose prefix is still
        cached from the previous generation is evaluated from where they differ unless reset."""

    def eval(self, tokens: list[int]) -> None:
        self.n_tokens += len(tokens)

    def reset(self) -> None:
        self.n_tokens = 0

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(self, tokens: list[int], reset: bool, **sampling):
        self.sampling = sampling
        reused = 0
        if reset and self.n_tokens > 0:
            while reused < min(len(tokens) - 1, len(self.cached)) and self.cached[reused] == tokens[reused]:
                reused += 1
        self.cached, self.n_tokens = list(tokens), reused
        self.prefills.append(len(tokens) - reused)
        self.eval(list(tokens[reused:]))
        last = successor(tokens[-1])
        yield last
        while True:
            proposal = self.draft(last) if self.draft else []
            self.eval([last, *proposal])
            for guess in proposal:
                truth = successor(last)
                if guess != truth:
                    self.n_tokens -= len(proposal) - proposal.index(guess)
                    break
                last = truth
                yield last
            last = successor(last)
            yield last


@pytest.fixture
def binding(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.Llama = StandInLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = StandInLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)


def truth_after(prompt: list[int], count: int) -> list[int]:
    tokens = [prompt[-1]]
    for _ in range(count):
        tokens.append(successor(tokens[-1]))
    return tokens[1:]


def test_plain_decoding_is_one_token_a_round(binding, tmp_path) -> None:
    runner = LlamaCppRunner(MethodSpec("llama.cpp"), tmp_path / "m.gguf", end_token_ids=[1000])
    prompt = [5, 6, 7]
    done = runner.generate(Request(prompt, max_new_tokens=6))
    assert done.token_ids == truth_after(prompt, 6)
    assert done.acceptance_lengths == [1] * 5  # the prefill's token is not a round's
    assert done.verify_sizes == [1] * 5
    assert done.verify_contexts == [3, 4, 5, 6, 7]
    assert set(done.stages) == set(STAGE_NAMES)
    assert sum(done.stages.values()) == pytest.approx(done.seconds)
    assert runner.llm.sampling["temp"] == 0 and runner.llm.seed is None
    assert runner.dtype is None  # never compared token for token with our AR


def test_every_generation_prefills_its_whole_prompt(binding, tmp_path) -> None:
    """As ours do: a prompt still cached from the last generation (a repeat) must not speed the row up."""
    runner = LlamaCppRunner(MethodSpec("llama.cpp"), tmp_path / "m.gguf", end_token_ids=[1000])
    for _ in range(2):
        runner.generate(Request([5, 6, 7, 8], max_new_tokens=3))
    assert runner.llm.prefills == [4, 4]


def test_prompt_lookup_rounds_and_rolled_back_drafts(binding, tmp_path) -> None:
    runner = LlamaCppRunner(MethodSpec("llama.cpp-pld"), tmp_path / "m.gguf", [1000], lookup=True)
    prompt = [11, 12]
    done = runner.generate(Request(prompt, max_new_tokens=7))
    assert done.token_ids == truth_after(prompt, 7)
    assert done.acceptance_lengths == [3, 3]
    assert done.verify_sizes == [4, 4]
    assert done.verify_contexts == [2, 5]  # the rejected third draft is not cached
    assert runner.llm.draft.num_pred_tokens == 10
    assert runner.llm.options["logits_all"] is True  # the binding's buffer for drafted positions


def test_stops_at_an_end_token_and_samples_with_the_seed(binding, tmp_path) -> None:
    prompt = [5]
    end = truth_after(prompt, 3)[-1]
    runner = LlamaCppRunner(MethodSpec("llama.cpp"), tmp_path / "m.gguf", end_token_ids=[end])
    done = runner.generate(Request(prompt, max_new_tokens=50, temperature=0.7, top_k=20, seed=4))
    assert done.token_ids == truth_after(prompt, 3)
    assert runner.llm.seed == 4
    assert runner.llm.sampling["temp"] == 0.7 and runner.llm.sampling["top_k"] == 20


def test_unavailable_without_the_binding_or_a_gguf(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(MethodUnavailable, match="pip install"):
        LlamaCppRunner(MethodSpec("llama.cpp"), tmp_path / "m.gguf", [0])
    models = SimpleNamespace(target_spec=str(tmp_path), end_token_ids=[0])
    with pytest.raises(MethodUnavailable, match="runs a GGUF file"):
        build_method(models, MethodSpec("llama.cpp"))


def test_bad_specs_are_refused(binding, tmp_path) -> None:
    with pytest.raises(MethodUnavailable, match="bf16, f32"):
        LlamaCppRunner(MethodSpec("llama.cpp", "q8"), tmp_path / "m.gguf", [0])
    with pytest.raises(MethodUnavailable, match="no @dtype"):
        LlamaCppRunner(MethodSpec("llama.cpp", dtype="float32"), tmp_path / "m.gguf", [0])
