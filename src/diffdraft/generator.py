"""The user-facing entry point: load a target (and drafter) once, then generate or stream.

>>> import diffdraft
>>> gen = diffdraft.load(target="default", method="pld")
>>> result = gen.generate("def fibonacci(n):", max_new_tokens=64)
>>> result.text, result.stats.tau
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.batch_cost import load_or_measure_batch_cost
from diffdraft.budget.cost import load_or_measure
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.decoding.batching import BatchEngine
from diffdraft.decoding.engine import SequenceRun, SpeculativeEngine
from diffdraft.decoding.method_table import Drafting, Method, TreeRule, auto_budget_methods, method_named
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.base import Drafter
from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.families import FAMILIES, DraftModel, family_of, make_drafter
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.errors import InvalidRequestError
from diffdraft.ngram.shipped import load_ngram
from diffdraft.runtime.chat import encode_chat, encode_prompt
from diffdraft.runtime.detokenize import INCOMPLETE, IncrementalDecoder
from diffdraft.runtime.logprobs import MAX_TOP_LOGPROBS, LogprobRecorder, TokenLogprob
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.loading import LoadedModel, end_token_ids, load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, TreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

SEED_RANGE = (-(2**63), 2**64)
"""What a torch random generator accepts as a seed."""


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated tokens only (end token included when generation stopped on one)."""
    text: str
    """Decoded generated text, cut before a stop string if one ended generation."""
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per token of ``token_ids``."""

    def to_dict(self) -> dict:
        logprobs = {} if self.logprobs is None else {"logprobs": [t.to_dict() for t in self.logprobs]}
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            **logprobs,
            **self.stats.to_dict(),
        }


@dataclass
class GenerationChunk:
    """One streamed piece: the text and tokens a round added. The last chunk carries the result."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None
    """With the request's ``logprobs``: one per token of ``token_ids``."""


@dataclass
class GenerationRequest:
    """One generation's settings (what :meth:`SpeculativeGenerator.stream` takes)."""

    prompt: str | None = None
    """Text used as given (no chat template)."""
    messages: list[dict] | None = None
    """Chat messages; the target's chat template is applied."""
    prompt_token_ids: Sequence[int] | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    """Seeds the request's own random stream (sampling only): the same seed, the same output."""
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """K: also return the target's log-probability of every generated token and the K most likely
    tokens at its position (0 to 20; :mod:`diffdraft.runtime.logprobs`); None: none."""


@dataclass
class PreparedRequest:
    """A checked, encoded request and its output so far: text is decoded as tokens arrive and
    released in chunks that never show half a character or the start of a stop string."""

    spec: SequenceSpec
    """What the engine generates it from (``SpeculativeEngine.run``, ``BatchEngine.add``): its prompt,
    stop conditions, sampling, seed, stats and log-probability recorder, held once."""
    text_of: IncrementalDecoder
    generated: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    """Tokens whose text is not shown yet."""
    shown: str = ""

    def add(self, new: list[int]) -> GenerationChunk | None:
        """Take a round's tokens; the chunk of text they make visible, if any."""
        self.generated.extend(new)
        self.pending.extend(new)
        stop = self.spec.stop
        text = stop.cut_text(self.text_of(self.generated)).rstrip(INCOMPLETE)
        if stop.stop_strings:
            text = text[: max(0, len(text) - max(map(len, stop.stop_strings)) + 1)]
        if len(text) <= len(self.shown):
            return None
        chunk = GenerationChunk(text[len(self.shown) :], self.pending, logprobs=self._pending_logprobs())
        self.shown, self.pending = text, []
        return chunk

    def finish(self) -> GenerationChunk:
        """The rest of the text and the result, once generation ended."""
        spec = self.spec
        text = spec.stop.cut_text(self.text_of(self.generated))
        logprobs = None if spec.logprobs is None else spec.logprobs.tokens
        result = GenerationResult(list(spec.prompt_ids), self.generated, text, spec.stats, logprobs)
        return GenerationChunk(text[len(self.shown) :], self.pending, result, self._pending_logprobs())

    def _pending_logprobs(self) -> list[TokenLogprob] | None:
        recorder = self.spec.logprobs
        if recorder is None:
            return None
        return recorder.tokens[len(self.generated) - len(self.pending) : len(self.generated)]


def _make_drafter(
    method: Method,
    drafter: str | os.PathLike | DraftModel | None,
    target: TargetModel,
    tokenizer,
    plans_rounds: bool = False,
) -> Drafter | None:
    """``tokenizer``: the target's, so a drafter that reads token ids only (DEER) is checked against it;
    ``plans_rounds``: whether an auto budget plans its rounds (a lookup boost then remembers what its
    copies earned across requests)."""
    if method.drafting is Drafting.NONE:
        return None
    if method.drafting is Drafting.LOOKUP:  # its copies sized by what verifying costs here
        return PromptLookupDrafter(verify_seconds=load_or_measure(target, progress=True))
    if drafter is None or drafter == "none":
        *most, last = (family.name for family in FAMILIES.values())
        families = f"{', '.join(most)} or {last}" if most else last
        raise InvalidRequestError(
            f"method {method.name!r} needs a drafter: pass a {families} checkpoint directory "
            "(--drafter PATH), or use --method ar or pld, which need none"
        )
    model = load_draft_model(drafter) if isinstance(drafter, (str, os.PathLike)) else drafter
    made = make_drafter(model, target, tokenizer)
    if method.family is not None and family_of(model).key != method.family:
        required = FAMILIES[method.family]
        raise InvalidRequestError(
            f"method {method.name!r} needs a {required.name} drafter ({required.made_by}); "
            f"{_drafter_name(drafter)} is a {model.variant} drafter: use --method chain or ddtree for it"
        )
    return LookupBoostedDrafter(made, remember=plans_rounds) if method.lookup_boost else made


def _drafter_name(drafter: str | os.PathLike | DraftModel) -> str:
    return str(drafter) if isinstance(drafter, (str, os.PathLike)) else "the given drafter"


def _budget_or_default(method: Method, budget: int | str | None) -> int | str | None:
    """``budget``, or for None the method's default (for the DDTree methods "auto": the best fixed
    budget depends on the machine, and a big one ran slower than plain AR on a small CPU;
    docs/decisions.md, "the DDTree methods default to the auto budget")."""
    return method.default_budget if budget is None else budget


def _make_builder(
    method: Method, budget: int | str | None, target: TargetModel, ngram, tokenizer
) -> TreeBuilder:
    """``budget`` None: the method's default (:func:`_budget_or_default`)."""
    budget = _budget_or_default(method, budget)
    if method.tree is TreeRule.DART:
        if budget == "auto":
            raise InvalidRequestError(
                f"budget 'auto' applies to {', '.join(auto_budget_methods())}; "
                f"give {method.name} a tree size, e.g. --budget 59"
            )
        return DartTreeBuilder(DartTreeSettings(tree_size=budget), load_ngram(ngram, tokenizer))
    if method.tree is TreeRule.CHAIN:
        return ChainBuilder()
    if budget == "auto":
        planner = BudgetPlanner(load_or_measure(target, progress=True))
        batch_cost = functools.partial(load_or_measure_batch_cost, target, progress=True)  # on first batch
        return AutoBudgetBuilder(planner, batch_cost=batch_cost)
    return DDTreeBuilder(budget)


class SpeculativeGenerator:
    """A loaded target + drafter + tree rule, reusable across requests."""

    def __init__(
        self,
        target: LoadedModel,
        method: str = "ar",
        drafter: str | os.PathLike | DraftModel | None = None,
        budget: int | str | None = None,
        ngram: str | os.PathLike | None = None,
        builder: TreeBuilder | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """``ngram``: the N-gram trie of the ``dart`` tree (a directory, ``"default"`` for the one
        shipped for the default target, or None for none). ``builder``: a tree rule built by the
        caller, used instead of the one ``method``, ``budget`` and ``ngram`` make (the benchmark's
        auto budget plans over its own cost curve, its dart tree times each trie lookup); an auto
        budget given here learns from every finished request like the one made here. ``cuda_graphs``:
        verify by replaying CUDA graphs (:class:`~diffdraft.target.model.TargetModel`), for CUDA targets."""
        row = method_named(method)
        self.loaded = target
        self.tokenizer = target.tokenizer
        self.target = TargetModel(target.model, cuda_graphs=cuda_graphs)
        self.method = method
        if builder is None:  # the auto budget's, made below (after the drafter: it may measure a while)
            plans_rounds = row.tree is TreeRule.DDTREE and _budget_or_default(row, budget) == "auto"
        else:
            plans_rounds = isinstance(builder, AutoBudgetBuilder)
        self.drafter: Drafter | None = _make_drafter(row, drafter, self.target, self.tokenizer, plans_rounds)
        if builder is None:
            builder = _make_builder(row, budget, self.target, ngram, self.tokenizer)
        self.engine = SpeculativeEngine(self.target, self.drafter, builder)
        self._auto_budget = builder if isinstance(builder, AutoBudgetBuilder) else None
        self.end_token_ids = end_token_ids(target.model, target.tokenizer)

    def generate(self, prompt: str | None = None, **options) -> GenerationResult:
        """Generate to completion; same arguments as :meth:`stream`."""
        *_, last = self.stream(prompt, **options)
        return last.result

    def stream(self, prompt: str | None = None, **options) -> Iterator[GenerationChunk]:
        """Yield text as rounds commit tokens. ``options`` are :class:`GenerationRequest`'s fields:
        exactly one of prompt (used as given), messages (chat template applied) or
        prompt_token_ids, and the sampling and stopping settings."""
        request = self.prepare(GenerationRequest(prompt, **options))
        for new in self.engine.run(request.spec):
            chunk = request.add(new)
            if chunk is not None:
                yield chunk
        yield self.finish(request)

    def generate_batch(
        self, requests: Sequence[GenerationRequest | str], max_batch_size: int = 8
    ) -> list[GenerationResult]:
        """Generate several requests together (strings are prompts with default settings); see
        :meth:`stream_batch`. Results come in the order of ``requests``."""
        results: list[GenerationResult | None] = [None] * len(requests)
        for index, result in self.stream_batch(requests, max_batch_size):
            results[index] = result
        return results

    def stream_batch(
        self, requests: Sequence[GenerationRequest | str], max_batch_size: int = 8
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Yield ``(index in requests, result)`` as each request finishes. Up to ``max_batch_size``
        requests share each round's target forward, and a waiting request joins as soon as another
        finishes. Each result is the one :meth:`generate` gives for that request alone. Every request
        is checked before any is generated."""
        if max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be >= 1, got {max_batch_size}")
        prepared = [
            self.prepare(r if isinstance(r, GenerationRequest) else GenerationRequest(r)) for r in requests
        ]
        batch = BatchEngine(self.engine)
        running: dict[SequenceRun, int] = {}
        waiting = list(range(len(prepared)))
        while waiting or batch.active:
            while waiting and len(batch.active) < max_batch_size:
                index = waiting.pop(0)
                request = prepared[index]
                sequence, first = batch.add(request.spec)
                request.add(first)
                if sequence.done:
                    yield index, self.finish(request).result
                else:
                    running[sequence] = index
            for sequence, new in batch.step():
                request = prepared[running[sequence]]
                request.add(new)
                if sequence.done:
                    yield running.pop(sequence), self.finish(request).result

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Check and encode a request (an :class:`InvalidRequestError` names what is wrong)."""
        prompt_ids = self._encode(request.prompt, request.messages, request.prompt_token_ids)
        sampling = SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p)
        seed = request.seed
        if seed is not None and not (isinstance(seed, int) and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
            raise InvalidRequestError(
                f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}), got {seed!r}"
            )
        if seed is None and not sampling.greedy:
            seed = int(torch.randint(0, 2**62, ()).item())
        logprobs = request.logprobs
        valid = (
            isinstance(logprobs, int) and not isinstance(logprobs, bool) and 0 <= logprobs <= MAX_TOP_LOGPROBS
        )
        if logprobs is not None and not valid:
            raise InvalidRequestError(
                "logprobs must be None or the number of top alternatives per token, "
                f"0 to {MAX_TOP_LOGPROBS}; got {logprobs!r}"
            )
        text_of = IncrementalDecoder(self._decode)  # the output's text each round, decoding its tail
        stop_conditions = StopConditions(
            end_token_ids=() if request.ignore_eos else self.end_token_ids,
            max_new_tokens=request.max_new_tokens,
            max_total_tokens=self.target.max_context,
            prompt_length=len(prompt_ids),
            stop_strings=request.stop,
            decode=text_of,
        )
        recorder = None if logprobs is None else LogprobRecorder(logprobs)
        spec = SequenceSpec(prompt_ids, stop_conditions, sampling, seed=seed, logprobs=recorder)
        return PreparedRequest(spec, text_of)

    def finish(self, request: PreparedRequest) -> GenerationChunk:
        """The last chunk of a request whose generation ended, with its result; the auto budget
        learns from what its rounds accepted and cost."""
        if self._auto_budget is not None:
            self._auto_budget.observe_generation(request.spec.stats)
        return request.finish()

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


def load(
    target: str | os.PathLike = "default",
    drafter: str | os.PathLike | None = None,
    method: str = "ar",
    budget: int | str | None = None,
    dtype: str = "auto",
    device: str | None = None,
    ngram: str | os.PathLike | None = None,
    cuda_graphs: bool = False,
) -> SpeculativeGenerator:
    """Load a target (``"default"``, a model directory or a ``.gguf`` file) and a drafter once.

    ``budget="auto"`` (the default for ddtree, ddtree+pld and deer-tree) picks the DDTree budget from
    this machine's verification cost (a few forwards timed once per model shape and device, seconds on
    a 2-core CPU, then cached and corrected by the rounds); ``method="pld"`` sizes its copies by the
    same cost; for ``method="dart"`` the budget is the tree size (default
    32, its row of :data:`~diffdraft.decoding.method_table.METHODS`) and ``ngram`` the N-gram trie directory
    (``"default"``: the one shipped for the default target; None: no N-gram term).
    ``method="deer"`` / ``"deer-tree"`` need a DEER drafter (e.g. ``"default-deer"``).
    On CPU the target runs diffdraft's inference kernels (same outputs, faster), so the loaded
    models are for inference only. ``cuda_graphs=True`` (a CUDA target of a family the lean forward
    runs, without sliding windows) replays each verification forward from a CUDA graph instead of
    launching its kernels one by one, which makes a GPU round several times faster
    (docs/decisions.md, "GPU verification replayed from CUDA graphs").
    """
    method_named(method)  # before the (slow) model load
    loaded = load_target(target, dtype=dtype, device=device, optimize=True)
    return SpeculativeGenerator(loaded, method, drafter, budget, ngram, cuda_graphs=cuda_graphs)
