"""The user-facing entry point: load a target (and drafter) once, then generate or stream.

>>> import diffdraft
>>> gen = diffdraft.load(target="default", method="pld")
>>> result = gen.generate("def fibonacci(n):", max_new_tokens=64)
>>> result.text, result.stats.tau
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from diffdraft.budget import AutoBudgetBuilder, BudgetPlanner, load_or_measure
from diffdraft.chat import encode_chat, encode_prompt
from diffdraft.detokenize import INCOMPLETE, IncrementalDecoder
from diffdraft.drafters.base import Drafter
from diffdraft.drafters.checkpoint import DraftModel
from diffdraft.drafters.deer import DEERDrafter
from diffdraft.drafters.families import make_drafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.engine import SpeculativeEngine
from diffdraft.errors import InvalidRequestError
from diffdraft.loading import LoadedModel, end_token_ids, load_target
from diffdraft.ngram.shipped import load_ngram
from diffdraft.sampling import SamplingParams
from diffdraft.stats import GenerationStats
from diffdraft.stopping import StopConditions
from diffdraft.target import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, TreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

METHODS = ("ar", "pld", "chain", "ddtree", "chain+pld", "ddtree+pld", "dart", "deer", "deer-tree")
"""ar: plain decoding; pld: prompt lookup chain; chain: drafter argmax/sampled chain; ddtree: optimal
tree; ``+pld``: the drafter's proposal boosted by prompt lookup's copied continuation (lookup_boost.py);
dart: DART's N-gram-pruned beam tree (trees/dart.py). Any drafter checkpoint serves any of these.
deer / deer-tree: DEER's decoding (a chain verified by rejection sampling, its Eq. 5-6) and DDTree
over a DEER drafter; they name the drafter family too, so they take DEER drafters only."""
DEER_METHODS = ("deer", "deer-tree")
DDTREE_METHODS = ("ddtree", "ddtree+pld", "deer-tree")
"""Methods whose tree is DDTree's (and so take a node budget, 'auto' included)."""


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated tokens only (end token included when generation stopped on one)."""
    text: str
    """Decoded generated text, cut before a stop string if one ended generation."""
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            **self.stats.to_dict(),
        }


@dataclass
class GenerationChunk:
    """One streamed piece: the text and tokens a round added. The last chunk carries the result."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise InvalidRequestError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def _make_drafter(
    method: str, drafter: str | os.PathLike | DraftModel | None, target: TargetModel, tokenizer
) -> Drafter | None:
    """``tokenizer``: the target's, so a drafter that reads token ids only (DEER) is checked against it."""
    if method == "ar":
        return None
    if method == "pld":
        return PromptLookupDrafter()
    if drafter is None or drafter == "none":
        raise InvalidRequestError(
            f"method {method!r} needs a drafter: pass a DFlash/DFlare, DART or DEER checkpoint directory "
            "(--drafter PATH), or use --method ar or pld, which need none"
        )
    made = make_drafter(drafter, target, tokenizer)
    if method in DEER_METHODS and not isinstance(made, DEERDrafter):
        raise InvalidRequestError(
            f"method {method!r} needs a DEER drafter (diffdraft deer init / train fit --variant deer); "
            f"{_drafter_name(drafter)} is a {made.model.variant} drafter: use --method chain or ddtree for it"
        )
    return LookupBoostedDrafter(made) if method.endswith("+pld") else made


def _drafter_name(drafter: str | os.PathLike | DraftModel) -> str:
    return str(drafter) if isinstance(drafter, (str, os.PathLike)) else "the given drafter"


def _make_builder(method: str, budget: int | str, target: TargetModel, ngram, tokenizer) -> TreeBuilder:
    if method == "dart":
        if budget == "auto":
            raise InvalidRequestError(
                f"budget 'auto' applies to {', '.join(DDTREE_METHODS)}; give dart a tree size, "
                "e.g. --budget 59"
            )
        return DartTreeBuilder(DartTreeSettings(tree_size=budget), load_ngram(ngram, tokenizer))
    if method not in DDTREE_METHODS:
        return ChainBuilder()
    if budget == "auto":
        return AutoBudgetBuilder(BudgetPlanner(load_or_measure(target, progress=True)))
    return DDTreeBuilder(budget)


class SpeculativeGenerator:
    """A loaded target + drafter + tree rule, reusable across requests."""

    def __init__(
        self,
        target: LoadedModel,
        method: str = "ar",
        drafter: str | os.PathLike | DraftModel | None = None,
        budget: int | str = 32,
        ngram: str | os.PathLike | None = None,
    ) -> None:
        """``ngram``: the N-gram trie of the ``dart`` tree (a directory, ``"default"`` for the one
        shipped for the default target, or None for none)."""
        _check_method(method)
        self.loaded = target
        self.tokenizer = target.tokenizer
        self.target = TargetModel(target.model)
        self.method = method
        self.drafter: Drafter | None = _make_drafter(method, drafter, self.target, self.tokenizer)
        builder = _make_builder(method, budget, self.target, ngram, self.tokenizer)
        self.engine = SpeculativeEngine(self.target, self.drafter, builder)
        self._auto_budget = builder if isinstance(builder, AutoBudgetBuilder) else None
        self.end_token_ids = end_token_ids(target.model, target.tokenizer)

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Generate to completion; same arguments as :meth:`stream`."""
        *_, last = self.stream(prompt, **kwargs)
        return last.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
    ) -> Iterator[GenerationChunk]:
        """Yield text as rounds commit tokens. Give exactly one of prompt (used as given),
        messages (chat template applied) or prompt_token_ids."""
        prompt_ids = self._encode(prompt, messages, prompt_token_ids)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if seed is None and not sampling.greedy:
            seed = int(torch.randint(0, 2**62, ()).item())
        text_of = IncrementalDecoder(self._decode)  # the output's text each round, decoding its tail
        stop_conditions = StopConditions(
            end_token_ids=() if ignore_eos else self.end_token_ids,
            max_new_tokens=max_new_tokens,
            max_total_tokens=self.target.max_context,
            prompt_length=len(prompt_ids),
            stop_strings=stop,
            decode=text_of,
        )
        stats = GenerationStats()
        generated: list[int] = []
        pending: list[int] = []  # tokens whose text is not shown yet
        shown = ""
        for new in self.engine.run(prompt_ids, stop_conditions, sampling, stats, seed):
            generated.extend(new)
            pending.extend(new)
            text = self._visible_text(text_of(generated), stop_conditions)
            if len(text) > len(shown):
                yield GenerationChunk(text=text[len(shown) :], token_ids=pending)
                shown, pending = text, []
        if self._auto_budget is not None:
            # the budget planner learns what this generation's rounds accepted and what they cost
            outside = sum(
                seconds for stage, seconds in stats.timings.items() if stage not in ("prefill", "verify")
            )
            self._auto_budget.observe_generation(stats, outside / max(1, stats.rounds))
        text = stop_conditions.cut_text(text_of(generated))
        result = GenerationResult(list(prompt_ids), generated, text, stats)
        yield GenerationChunk(text=text[len(shown) :], token_ids=pending, result=result)

    def _encode(self, prompt, messages, prompt_token_ids) -> list[int]:
        given = [x is not None for x in (prompt, messages, prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages or prompt_token_ids")
        if messages is not None:
            return encode_chat(self.tokenizer, messages)
        if prompt is not None:
            return encode_prompt(self.tokenizer, prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids or not all(0 <= t < self.target.vocab_size for t in ids):
            raise InvalidRequestError(
                f"prompt_token_ids must be a non-empty list of ids in [0, {self.target.vocab_size})"
            )
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @staticmethod
    def _visible_text(text: str, stop: StopConditions) -> str:
        """Text safe to show now: no half-decoded characters, no prefix of a stop string yet."""
        text = stop.cut_text(text).rstrip(INCOMPLETE)
        if stop.stop_strings:
            text = text[: max(0, len(text) - max(map(len, stop.stop_strings)) + 1)]
        return text


def load(
    target: str | os.PathLike = "default",
    drafter: str | os.PathLike | None = None,
    method: str = "ar",
    budget: int | str = 32,
    dtype: str = "auto",
    device: str | None = None,
    ngram: str | os.PathLike | None = None,
) -> SpeculativeGenerator:
    """Load a target (``"default"``, a model directory or a ``.gguf`` file) and a drafter once.

    ``budget="auto"`` picks the DDTree budget (ddtree, ddtree+pld, deer-tree) from this machine's
    measured verification cost; for ``method="dart"`` the budget is the tree size and ``ngram`` the
    N-gram trie directory (``"default"``: the one shipped for the default target; None: no N-gram
    term). ``method="deer"`` / ``"deer-tree"`` need a DEER drafter (e.g. ``"default-deer"``).
    On CPU the target runs diffdraft's inference kernels (same outputs, faster), so the loaded
    models are for inference only.
    """
    _check_method(method)  # before the (slow) model load
    loaded = load_target(target, dtype=dtype, device=device, optimize=True)
    return SpeculativeGenerator(loaded, method, drafter, budget, ngram)
