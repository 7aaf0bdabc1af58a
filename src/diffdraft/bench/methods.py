"""The methods a benchmark compares: a registry of named runners over one shared set of models.

A method is a name plus a factory. Ours wrap :class:`~diffdraft.generator.SpeculativeGenerator`;
the Hugging Face ones wrap ``model.generate``. A spec on the command line is ``name[:arg][@dtype]``:
``ddtree:32`` (budget 32), ``ddtree:auto`` (budget chosen by the cost model), ``hf-pld:3`` (3 lookup
tokens), ``hf@float32`` (HF greedy on a float32 copy of the target). Adding a drafter later is one
:func:`register` call; the runner and the report never learn method names.

DART runs beside DFlash/DFlare: ``dart:SIZE`` (DART drafter, DART's N-gram-pruned tree of SIZE
nodes), ``dart-no-ngram:SIZE`` (the same tree without the N-gram term) and ``ddtree-dart:BUDGET``
(DDTree over the DART drafter's distributions); ``dart-tree:SIZE`` is DART's N-gram-pruned tree over
``--drafter``'s (DFlash/DFlare) distributions, the tree rule compared on the main drafter. The N-gram
trie is loaded once and shared; the benchmark wraps it in a :class:`~diffdraft.bench.probes.TimedNgram`,
so a ``dart`` round's tree time splits into the lookups (stage ``ngram``) and the tree search around
them (stage ``tree``).

DEER (a diffusion LM drafter that reads tokens only) runs beside them too: ``deer`` (its chain,
verified by rejection sampling) and ``deer-tree:BUDGET`` (DDTree over its distributions), both
with the drafter of ``--deer-drafter``.

llama.cpp, the engine CPU users run on a GGUF, is a baseline row: ``llama.cpp`` (the target's GGUF
as it is), ``llama.cpp:bf16`` (the same weights dense, our precision) and ``llama.cpp-pld`` (its
prompt lookup decoding); skipped with one line when ``llama-cpp-python`` is not installed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from diffdraft.bench.llamacpp import LlamaCppRunner
from diffdraft.bench.probes import ForwardProbe, TimedNgram, rounds_from_calls
from diffdraft.bench.runner_api import (
    STAGE_NAMES,
    Completion,
    MethodRunner,
    MethodSpec,
    MethodUnavailable,
    Request,
)
from diffdraft.budget.auto_budget import AutoBudgetBuilder
from diffdraft.budget.batch_cost import BatchCostCurve, load_or_measure_batch_cost
from diffdraft.budget.cost import VerifyCostCurve, load_or_measure
from diffdraft.budget.planner import BudgetPlanner
from diffdraft.decoding.method_table import METHODS, TreeRule
from diffdraft.drafters.checkpoint import load_draft_model, resolve_drafter_path
from diffdraft.drafters.dart_model import DART
from diffdraft.drafters.deer_model import DEER
from diffdraft.drafters.families import FAMILIES, DraftModel, family_of
from diffdraft.errors import CheckpointError, InvalidRequestError
from diffdraft.generator import SpeculativeGenerator
from diffdraft.ngram import NgramTrie
from diffdraft.ngram.shipped import load_ngram
from diffdraft.runtime.stats import STAGES
from diffdraft.target.default_model import default_gguf_path
from diffdraft.target.loading import DTYPES, LoadedModel, end_token_ids, load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings

REFERENCE = "ar"
"""The method every other is timed and checked against."""
DART_PAPER_TREE_SIZE = 59
"""The DART paper's tree size: what the dart methods of the benchmark run when given no argument (the
generator's own default, the dart row of :data:`diffdraft.decoding.method_table.METHODS`, is smaller to pay on
a CPU)."""
FAMILY_DRAFTER_OPTIONS = {DART: ("--dart-drafter", "default-dart"), DEER: ("--deer-drafter", "default-deer")}
"""The option naming a family's own drafter, whose methods run beside ``--drafter``'s (any family's),
and the drafter shipped for the default target."""


class BenchModels:
    """Every model a benchmark needs, each loaded once and shared by all methods that use it."""

    def __init__(
        self,
        target: str | os.PathLike,
        dtype: str = "auto",
        device: str | None = None,
        drafter: str | os.PathLike | None = None,
        assistant: str | os.PathLike | None = None,
        cost_cache: str | os.PathLike | None = None,
        refresh_cost: bool = False,
        progress: bool = False,
        dart_drafter: str | os.PathLike | None = None,
        ngram: str | os.PathLike | None = None,
        deer_drafter: str | os.PathLike | None = None,
    ) -> None:
        """``drafter``: the DFlash/DFlare checkpoint (or ``"default"``); ``dart_drafter``: the DART one
        (or ``"default-dart"``); ``ngram``: the DART tree's trie (a directory, ``"default"`` or None /
        ``"none"``), loaded the first time a method needs it; ``deer_drafter``: the DEER checkpoint
        (or ``"default-deer"``)."""
        self.target_spec = target
        self.drafter_path = drafter
        self.family_drafter_paths = {DART: dart_drafter, DEER: deer_drafter}
        self.ngram_spec = ngram
        self.assistant_path = assistant
        self.cost_cache = cost_cache
        self.refresh_cost = refresh_cost
        self.progress = progress
        main = load_target(target, dtype=dtype, device=device, optimize=True)
        self.dtype_name = str(main.model.dtype).removeprefix("torch.")
        self.device = main.model.device
        self._targets: dict[tuple[str, bool], LoadedModel] = {(self.dtype_name, True): main}
        self._drafters: dict[tuple[str, str], DraftModel] = {}
        self._ngram: NgramTrie | None = None
        self._assistants: dict[str, PreTrainedModel] = {}
        self._curve: VerifyCostCurve | None = None
        self._batch_curve: BatchCostCurve | None = None
        self.tokenizer = main.tokenizer
        self.end_token_ids = end_token_ids(main.model, main.tokenizer)

    @property
    def main(self) -> LoadedModel:
        """The target our methods run, in the run's dtype."""
        return self.target()

    def target(self, dtype: str | None = None, optimized: bool = True) -> LoadedModel:
        """Our methods run the target with diffdraft's inference kernels (``load_target(optimize=True)``);
        the Hugging Face baselines get ``optimized=False``, the stock model users have."""
        dtype = dtype or self.dtype_name
        if (dtype, optimized) not in self._targets:
            self._targets[dtype, optimized] = load_target(
                self.target_spec, dtype=dtype, device=self.device, optimize=optimized
            )
        return self._targets[dtype, optimized]

    def draft_model(self, dtype: str | None = None) -> DraftModel:
        """One drafter per dtype: the generator casts it to its target's dtype in place."""
        if self.drafter_path is None:
            raise MethodUnavailable("this method needs a drafter checkpoint: pass --drafter PATH")
        return self._draft_model("drafter", self.drafter_path, dtype)

    def family_model(self, family: str, dtype: str | None = None) -> DraftModel:
        """The drafter of ``family``'s own option (:data:`FAMILY_DRAFTER_OPTIONS`), one per dtype like
        :meth:`draft_model`; a shipped one this installation lacks makes its methods unavailable
        (skipped in a default run), like a drafter not given."""
        option, shipped = FAMILY_DRAFTER_OPTIONS[family]
        name = FAMILIES[family].name
        path = self.family_drafter_paths[family]
        if path is None:
            raise MethodUnavailable(
                f"this method needs a {name} drafter checkpoint: pass {option} PATH|{shipped}"
            )
        try:
            resolve_drafter_path(path)
        except CheckpointError as error:
            raise MethodUnavailable(str(error)) from error
        model = self._draft_model(family, path, dtype)
        given = family_of(model).key
        if given != family:
            other = FAMILY_DRAFTER_OPTIONS[given][0] if given in FAMILY_DRAFTER_OPTIONS else "--drafter"
            raise InvalidRequestError(
                f"{option} {path} is a {model.variant} checkpoint, not a {name} one; pass it as {other}"
            )
        return model

    def _draft_model(self, role: str, path: str | os.PathLike, dtype: str | None) -> DraftModel:
        key = (role, dtype or self.dtype_name)
        if key not in self._drafters:
            self._drafters[key] = load_draft_model(path)
        return self._drafters[key]

    def ngram(self) -> NgramTrie | None:
        """The DART tree's N-gram trie (checked against the target's tokenizer), loaded once."""
        if self._ngram is None:
            self._ngram = load_ngram(self.ngram_spec, self.tokenizer, progress=self.progress)
        return self._ngram

    def assistant(self, dtype: str | None = None) -> PreTrainedModel:
        dtype = dtype or self.dtype_name
        if self.assistant_path is None:
            raise MethodUnavailable("hf-assisted needs an assistant model directory: pass --assistant PATH")
        if dtype not in self._assistants:
            self._assistants[dtype] = AutoModelForCausalLM.from_pretrained(
                self.assistant_path, dtype=DTYPES[dtype], device_map=self.device, local_files_only=True
            ).eval()
        return self._assistants[dtype]

    def cost_curve(self) -> VerifyCostCurve:
        """t(q) of the main target on this machine (probed once, then read from the cache)."""
        if self._curve is None:
            self._curve = load_or_measure(
                TargetModel(self.main.model),
                refresh=self.refresh_cost,
                cache_dir=self.cost_cache,
                progress=self.progress,
            )
        return self._curve

    def batch_cost_curve(self) -> BatchCostCurve:
        """What forwards shared by several sequences cost the main target on this machine (measured
        once, then read from the cache, beside :meth:`cost_curve`'s): the curve the generator's own
        auto budget plans batches with, so the bench measures what users run."""
        if self._batch_curve is None:
            self._batch_curve = load_or_measure_batch_cost(
                TargetModel(self.main.model),
                cache_dir=None if self.cost_cache is None else Path(self.cost_cache) / "batch",
                progress=self.progress,
                refresh=self.refresh_cost,
            )
        return self._batch_curve


MethodFactory = Callable[[BenchModels, MethodSpec], MethodRunner]


@dataclass
class MethodEntry:
    factory: MethodFactory
    default_args: tuple[str | None, ...] = (None,)
    """Specs a default run includes, one per arg (``budget`` means the run's budget list)."""


_REGISTRY: dict[str, MethodEntry] = {}


def register(name: str, factory: MethodFactory, default_args: tuple[str | None, ...] = (None,)) -> None:
    """Make ``name`` runnable by the benchmark (replacing an entry of the same name)."""
    _REGISTRY[name] = MethodEntry(factory, default_args)


def registered() -> list[str]:
    return list(_REGISTRY)


def default_specs(budgets: list[str]) -> list[MethodSpec]:
    """Every registered method once, with ``budget`` args expanded to each budget."""
    specs = []
    for name, entry in _REGISTRY.items():
        for arg in entry.default_args:
            args = budgets if arg == "budget" else [arg]
            specs.extend(MethodSpec(name, a) for a in args)
    return specs


def build_method(models: BenchModels, spec: MethodSpec) -> MethodRunner:
    entry = _REGISTRY.get(spec.name)
    if entry is None:
        raise InvalidRequestError(f"unknown method {spec.name!r}; registered: {', '.join(_REGISTRY)}")
    return entry.factory(models, spec)


class OursRunner:
    """A method of this project: :class:`SpeculativeGenerator` with the matching drafter and tree rule."""

    def __init__(
        self,
        models: BenchModels,
        spec: MethodSpec,
        needs_drafter: bool,
        method: str | None = None,
        drafter: DraftModel | None = None,
        ngram: NgramTrie | None = None,
        default_budget: int = 32,
    ) -> None:
        """``method``: the generator's method (default ``spec.name``); ``drafter``: a draft network
        other than ``--drafter``'s; ``ngram``: the trie of the ``dart`` tree, timed per lookup."""
        self.spec = spec
        loaded = models.target(spec.dtype)
        self.dtype = loaded.model.dtype
        method = method or spec.name
        budget = default_budget if spec.arg in (None, "auto") else _positive_int(spec)
        if drafter is None and needs_drafter:
            drafter = models.draft_model(spec.dtype)
        builder = None
        self.lookups: TimedNgram | None = None
        if ngram is not None:
            if METHODS[method].tree is not TreeRule.DART:
                raise InvalidRequestError(f"{spec.label}: only the dart tree takes an N-gram trie")
            self.lookups = TimedNgram(ngram)
            builder = DartTreeBuilder(DartTreeSettings(tree_size=budget), self.lookups)
        self.auto: AutoBudgetBuilder | None = None
        if spec.arg == "auto":
            if not METHODS[method].auto_budget:
                raise InvalidRequestError(f"{spec.label}: only DDTree methods take an auto budget")
            builder = self.auto = AutoBudgetBuilder(
                BudgetPlanner(models.cost_curve()), batch_cost=models.batch_cost_curve, initial_budget=budget
            )
        self.generator = SpeculativeGenerator(loaded, method, drafter=drafter, budget=budget, builder=builder)

    def generate(self, request: Request) -> Completion:
        if self.lookups is not None:
            self.lookups.take()  # a fresh count per generation
        begin = time.perf_counter()
        result = self.generator.generate(
            prompt_token_ids=request.prompt_token_ids,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
        )
        seconds = time.perf_counter() - begin
        stats = result.stats
        stages = {name: stats.timings[name] for name in STAGES}
        stages["verify_forward"] = stages.pop("verify")
        lookups = self.lookups.take() if self.lookups is not None else []
        stages["ngram"] = min(sum(lookups), stages["tree"])  # the lookups ran inside the tree stage
        stages["tree"] -= stages["ngram"]
        stages["other"] = max(0.0, seconds - sum(stages.values()))
        return Completion(
            token_ids=result.token_ids,
            seconds=seconds,
            acceptance_lengths=list(stats.acceptance_lengths),
            stages=stages,
            verify_sizes=[nodes + 1 for nodes in stats.tree_sizes],
            verify_seconds=list(stats.verify_seconds),
            verify_contexts=list(stats.verify_contexts),
            budgets=list(stats.budgets),
            draft_depths=list(stats.draft_depths),
            ngram_lookups=len(lookups),
            ngram_lookup_median=statistics.median(lookups) if lookups else 0.0,
        )


class HFRunner:
    """Hugging Face ``generate``: greedy / sampling, prompt lookup, or assisted by a smaller model."""

    def __init__(
        self, models: BenchModels, spec: MethodSpec, lookup: int | None = None, assisted: bool = False
    ) -> None:
        self.spec = spec
        self.model = models.target(spec.dtype, optimized=False).model
        self.dtype = self.model.dtype
        self.assistant = models.assistant(spec.dtype) if assisted else None
        self.lookup = lookup
        self.end_token_ids = models.end_token_ids
        self.pad_token_id = models.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.end_token_ids[0]

    def generate(self, request: Request) -> Completion:
        sampled = request.temperature > 0
        config = GenerationConfig(
            max_new_tokens=request.max_new_tokens,
            do_sample=sampled,
            temperature=request.temperature if sampled else None,
            top_p=request.top_p if sampled else None,
            top_k=request.top_k if sampled else None,
            eos_token_id=self.end_token_ids,
            pad_token_id=self.pad_token_id,
            prompt_lookup_num_tokens=self.lookup,
        )
        ids = torch.tensor([request.prompt_token_ids], device=self.model.device)
        if sampled:
            torch.manual_seed(request.seed)
        with ForwardProbe(self.model) as probe, ForwardProbe(self.assistant) as drafting:
            begin = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                assistant_model=self.assistant,
            )
            seconds = time.perf_counter() - begin
        token_ids = out[0, ids.shape[1] :].tolist()
        calls = probe.calls
        prompt_length = ids.shape[1]
        # Assisted decoding verifies its first candidates in the prefill forward: that forward is
        # a round (it commits them) but its time is the prefill's, and it verified candidates + 1.
        prefill_only = calls[0].tokens == prompt_length
        rounds = calls[1:] if prefill_only else calls
        sizes = [call.tokens for call in rounds]
        if not prefill_only:
            sizes[0] -= prompt_length - 1
        stages = dict.fromkeys(STAGE_NAMES, 0.0)
        stages["prefill"] = calls[0].seconds
        stages["verify_forward"] = sum(call.seconds for call in calls[1:])
        stages["draft"] = drafting.seconds
        stages["other"] = max(0.0, seconds - sum(stages.values()))
        return Completion(
            token_ids=token_ids,
            seconds=seconds,
            acceptance_lengths=rounds_from_calls(calls, prompt_length, len(token_ids)),
            stages=stages,
            verify_sizes=sizes,
            verify_seconds=[call.seconds for call in rounds],
            verify_contexts=[call.cached for call in rounds],
            draft_depths=[size - 1 for size in sizes],  # HF drafts chains: verified = root + drafts
            engine="transformers",
        )


def _positive_int(spec: MethodSpec) -> int:
    try:
        value = int(spec.arg)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise InvalidRequestError(
            f"{spec.label}: the argument must be a positive integer (or auto for ddtree)"
        )
    return value


def _ours(needs_drafter: bool) -> MethodFactory:
    return lambda models, spec: OursRunner(models, spec, needs_drafter)


def _dart(method: str, ngram: bool, main_drafter: bool = False) -> MethodFactory:
    """A method of the DART drafter (``--dart-drafter``; ``--drafter``'s if ``main_drafter``) with the
    generator's tree rule ``method``."""

    def factory(models: BenchModels, spec: MethodSpec) -> MethodRunner:
        # unavailable without the drafter: checked before any trie is built
        drafter = models.draft_model(spec.dtype) if main_drafter else models.family_model(DART, spec.dtype)
        trie = models.ngram() if ngram else None
        return OursRunner(
            models,
            spec,
            True,
            method=method,
            drafter=drafter,
            ngram=trie,
            default_budget=DART_PAPER_TREE_SIZE,
        )

    return factory


def _family_recipe(models: BenchModels, spec: MethodSpec) -> MethodRunner:
    """The generator's method of the same name, the recipe of one family, with that family's own
    drafter (e.g. ``deer`` with ``--deer-drafter``'s)."""
    drafter = models.family_model(METHODS[spec.name].family, spec.dtype)
    return OursRunner(models, spec, True, drafter=drafter)


def _llama_cpp(lookup: bool) -> MethodFactory:
    """llama.cpp on the target's GGUF file (see :mod:`diffdraft.bench.llamacpp`), with its prompt
    lookup decoding if ``lookup``."""

    def factory(models: BenchModels, spec: MethodSpec) -> MethodRunner:
        if str(models.target_spec) == "default":
            gguf = default_gguf_path()
        elif Path(models.target_spec).suffix.lower() == ".gguf":
            gguf = Path(models.target_spec)
        else:
            raise MethodUnavailable(
                f"{spec.label} runs a GGUF file: pass --target default or --target FILE.gguf "
                "(a Hugging Face directory has none)"
            )
        return LlamaCppRunner(spec, gguf, models.end_token_ids, lookup=lookup)

    return factory


def _hf(models: BenchModels, spec: MethodSpec) -> MethodRunner:
    if spec.arg is not None:
        raise InvalidRequestError(f"{spec.label}: hf takes no argument")
    return HFRunner(models, spec)


def _hf_pld(models: BenchModels, spec: MethodSpec) -> MethodRunner:
    return HFRunner(models, spec, lookup=_positive_int(spec) if spec.arg else 3)


def _hf_assisted(models: BenchModels, spec: MethodSpec) -> MethodRunner:
    return HFRunner(models, spec, assisted=True)


register("ar", _ours(needs_drafter=False))
register("hf", _hf)
register("hf-pld", _hf_pld, default_args=("3", "10"))  # HF PLD at its usual best settings
register("hf-assisted", _hf_assisted)
register("llama.cpp", _llama_cpp(lookup=False), default_args=(None, "bf16"))
register("llama.cpp-pld", _llama_cpp(lookup=True))
register("pld", _ours(needs_drafter=False))
register("chain", _ours(needs_drafter=True))
register("ddtree", _ours(needs_drafter=True), default_args=("budget",))
register("chain+pld", _ours(needs_drafter=True))
register("ddtree+pld", _ours(needs_drafter=True), default_args=("32",))
register("dart", _dart("dart", ngram=True), default_args=(str(DART_PAPER_TREE_SIZE),))
register("dart-no-ngram", _dart("dart", ngram=False), default_args=(str(DART_PAPER_TREE_SIZE),))
register("ddtree-dart", _dart("ddtree", ngram=False), default_args=(str(DART_PAPER_TREE_SIZE),))
register("dart-tree", _dart("dart", ngram=True, main_drafter=True), default_args=(str(DART_PAPER_TREE_SIZE),))
register("deer", _family_recipe)
register("deer-tree", _family_recipe, default_args=("32",))
