"""Round time per stage on random-weight models of real shapes: an inference benchmark with no downloads.

A round's cost depends on shapes (target, drafter, tree size, cached context), not on weight values, so
a random target of Qwen3-8B's shape and a random drafter of the official DFlash shape time a round as
the trained models would. Acceptance is what values decide, so a run fixes it (:data:`ACCEPTANCE`): a
random drafter is almost never right, and every method commits about one token per round (tau ~ 1),
ours and the official ``dflash`` loop alike; with the target's LM head zeroed every greedy pick is the
same token, and chains accept whole blocks. Rounds are then comparable, and since tau belongs to the
drafter, not to the loop, the ratio of two loops' round times is their speed ratio at equal acceptance.
Every run reports its tau and compares its tokens with plain decoding's, so a setup that feeds the
loops different weights or inputs shows.

A round is timed from the end of one verification forward to the end of the next: what one more round
adds to a generation. Our loop also splits it by stage (:class:`~diffdraft.runtime.stats.StageTimer`). The
official loop is the package's own ``dflash_generate``, run on the same target object with the same
drafter weights and observed through a forward hook on the target: none of its code is copied.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from diffdraft.bench.lossless import first_divergence
from diffdraft.bench.machine import cpu_name
from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFlashDraftModel, make_draft_config
from diffdraft.runtime.stats import STAGES, GenerationStats
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.loading import DTYPES as LOAD_DTYPES
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder, TreeBuilder

ROUND_STAGES = tuple(stage for stage in STAGES if stage != "prefill")
OFFICIAL = "dflash"
"""The method name of the official package's generation loop."""
REFERENCE = "ar"
"""Plain decoding: every method's tokens are compared with its tokens, and its round time is the unit
of the break-even tau."""
ACCEPTANCE = {
    "random": "random weights: drafts are almost never right, every loop commits about 1 token per round",
    "full": "the target's LM head zeroed: every greedy pick is token 0, the drafter's too (it borrows the "
    "head), so chains and the official loop accept whole blocks (DDTree's ties make its tau arbitrary)",
}
"""The two acceptance regimes a synthetic run can fix: no draft token accepted, or every one."""
DTYPES = LOAD_DTYPES | {"float64": torch.float64}  # float64: exact greedy ties in tests


@dataclass(frozen=True)
class SyntheticShape:
    """A Qwen3 target config and the DFlash drafter made for it."""

    target: dict
    """Qwen3Config keyword arguments."""
    draft_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    context: int
    """Default prompt length: the cached tokens the first round attends over."""


SHAPES = {
    "qwen3-8b": SyntheticShape(
        target=dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        # z-lab's Qwen3-8B-DFlash-b16: 5 layers of the target's width, block 16, 5 taps
        draft_layers=5,
        block_size=16,
        target_layer_ids=(1, 9, 17, 25, 33),
        mask_token_id=151669,
        context=512,
    ),
    "small": SyntheticShape(  # Qwen3-0.6B's shape: a CPU can run it in minutes
        target=dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        draft_layers=5,
        block_size=16,
        target_layer_ids=(1, 7, 13, 19, 25),
        mask_token_id=151669,
        context=256,
    ),
    "tiny": SyntheticShape(  # CI-sized: seconds on one CPU thread
        target=dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            initializer_range=0.2,  # peaked distributions: varied tokens, so the token check means something
        ),
        draft_layers=1,
        block_size=16,
        target_layer_ids=(0, 1, 2),
        mask_token_id=511,
        context=32,
    ),
}


@dataclass(frozen=True)
class Settings:
    """What one run times, and how; recorded with its results."""

    shape: str
    """A key of :data:`SHAPES`."""
    device: str
    dtype: str = "bfloat16"
    budgets: tuple[int, ...] = (8, 16, 32, 64)
    context: int | None = None
    """Prompt length; None: the shape's default."""
    rounds: int = 32
    """Timed rounds per method and repeat."""
    warmup: int = 4
    """Rounds run before the timed ones in every generation (kernels, allocator, caches)."""
    repeats: int = 1
    """Passes over all methods, interleaved so that drift in the machine hits every method alike."""
    acceptance: str = "random"
    """One of :data:`ACCEPTANCE`: which fixed acceptance every round runs at."""
    official: bool = True
    profile: bool = False
    """Also profile a few rounds of the chain and the largest DDTree (syncs, copies, launches)."""
    cuda_graphs: bool = False
    """Our loops verify through CUDA graphs (:class:`diffdraft.kernels.graphed_verify.GraphedVerify`)."""
    sdpa_backends: tuple[str, ...] = ()
    """The attention backends every loop may use (names of :class:`torch.nn.attention.SDPBackend`,
    lower case); empty: torch's own choice. On GPUs the drafter's stage took several times as long in
    some methods as in others at the same context; leaving cuDNN out tests whether its per-shape
    plans are why (docs/decisions.md, "the synthetic bench can leave attention backends out")."""
    seed: int = 0


@dataclass
class MethodTimes:
    """One method's timed rounds, over every repeat (warm-up rounds left out)."""

    method: str
    loop: str
    round_ms: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    """Tokens committed per round, the bonus token included (the papers' acceptance length)."""
    verified: list[int] = field(default_factory=list)
    """Tokens in each round's verification forward, the root included."""
    stage_ms: dict[str, list[float]] = field(default_factory=dict)
    """Per stage, its milliseconds in each round; empty for the official loop (not instrumented)."""
    tokens: list[int] = field(default_factory=list)
    """The tokens the first repeat generated, the prefill's first token included."""

    def summary(self, reference: MethodTimes | None, official: MethodTimes | None) -> dict:
        """The numbers a reader compares; ``reference``: plain decoding, ``official``: the dflash loop."""
        mean = statistics.fmean(self.round_ms)
        stages = {stage: statistics.fmean(ms) for stage, ms in self.stage_ms.items()}
        if stages:
            stages["other"] = mean - sum(stages.values())
        compared = min(len(self.tokens), len(reference.tokens)) if reference else 0
        return {
            "method": self.method,
            "loop": self.loop,
            "rounds": len(self.round_ms),
            "verified_tokens": statistics.fmean(self.verified),
            "tau": statistics.fmean(self.accepted),
            "round_ms_mean": mean,
            "round_ms_median": statistics.median(self.round_ms),
            "round_ms_min": min(self.round_ms),
            "stage_ms": stages,
            "break_even_tau": mean / statistics.fmean(reference.round_ms) if reference else None,
            "official_over_this": statistics.fmean(official.round_ms) / mean if official else None,
            "tokens_compared": compared,
            "tokens_matching_ar": _matching(self.tokens, reference.tokens) if reference else 0,
        }


def build_target(
    shape: SyntheticShape, device: torch.device, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    """A random Qwen3 target made on ``device`` in ``dtype`` directly: the 8B shape never exists on the
    host (on the meta device it never exists at all, for shape checks)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**shape.target), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def build_drafter(shape: SyntheticShape, target: PreTrainedModel, seed: int) -> DFlashDraftModel:
    """A random DFlash drafter in the official checkpoint layout, on the target's device and dtype."""
    config = make_draft_config(
        target.config,
        num_layers=shape.draft_layers,
        block_size=shape.block_size,
        mask_token_id=shape.mask_token_id,
        target_layer_ids=list(shape.target_layer_ids),
    )
    torch.manual_seed(seed + 1)
    with torch.device(target.device):
        drafter = DFlashDraftModel(config)
    return drafter.to(target.dtype).eval()


def official_drafter(drafter: DFlashDraftModel) -> nn.Module:
    """The ``dflash`` package's model holding ``drafter``'s weights: one set of weights, both loops.

    Raises ImportError without the package, and RuntimeError when the layouts disagree."""
    from dflash.model import DFlashDraftModel as OfficialDraftModel

    weight = next(drafter.parameters())
    with torch.device(weight.device):
        official = OfficialDraftModel(drafter.config)
    official = official.to(weight.dtype).eval()
    official.load_state_dict(drafter.state_dict(), strict=True)
    return official


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_prompt(shape: SyntheticShape, length: int, seed: int) -> list[int]:
    """Token ids below the mask token, the same for every method and loop."""
    generator = torch.Generator().manual_seed(seed)
    high = min(shape.target["vocab_size"], shape.mask_token_id)
    return torch.randint(0, high, (length,), generator=generator).tolist()


def engines(
    target: TargetModel, drafter: DFlashDrafter, budgets: tuple[int, ...]
) -> dict[str, SpeculativeEngine]:
    """Plain decoding, the chain and DDTree at each budget, by method name."""
    builders: dict[str, tuple[DFlashDrafter | None, TreeBuilder]] = {
        REFERENCE: (None, ChainBuilder()),
        "chain": (drafter, ChainBuilder()),
        **{f"ddtree:{budget}": (drafter, DDTreeBuilder(budget)) for budget in budgets},
    }
    return {name: SpeculativeEngine(target, d, builder) for name, (d, builder) in builders.items()}


def generation(
    engine: SpeculativeEngine, prompt: list[int], rounds: int, stats: GenerationStats
) -> Iterator[list[int]]:
    """``engine.run`` over ``prompt`` with a token limit no round of the ``rounds`` reaches, so none
    drafts less than its full depth; yields the prefill's token, then each round's tokens."""
    limit = (rounds + 2) * (engine.drafter.max_depth + 1 if engine.drafter else 1)
    stop = StopConditions((), limit, len(prompt) + limit + 1, len(prompt))
    return engine.run(SequenceSpec(prompt, stop, stats=stats))


def time_engine(
    engine: SpeculativeEngine, prompt: list[int], rounds: int, warmup: int, times: MethodTimes
) -> None:
    """Run ``warmup + rounds`` rounds of one generation and add the timed ones to ``times``."""
    stats = GenerationStats()
    device = engine.target.device
    run = generation(engine, prompt, warmup + rounds, stats)
    tokens = list(next(run))
    last = _clock(device)
    for index in range(warmup + rounds):
        before = dict(stats.timings)
        tokens += next(run)
        end = _clock(device)
        if index >= warmup:
            times.round_ms.append(1e3 * (end - last))
            for stage in ROUND_STAGES:
                times.stage_ms.setdefault(stage, []).append(1e3 * (stats.timings[stage] - before[stage]))
        last = end
    run.close()
    times.accepted += stats.acceptance_lengths[warmup:]
    times.verified += [size + 1 for size in stats.tree_sizes[warmup:]]
    times.tokens = times.tokens or tokens


def profile_rounds(engine: SpeculativeEngine, prompt: list[int], rounds: int, warmup: int) -> dict:
    """Operator counts and self times per round under ``torch.profiler`` (prefill and warm-up left
    out): the host syncs, copies and kernel launches a round makes, what CUDA graphs and static
    buffers would remove. The ``diffdraft.<stage>`` rows are the stages' own host time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.target.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    run = generation(engine, prompt, warmup + rounds, GenerationStats())
    for _ in range(1 + warmup):
        next(run)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(rounds):
            next(run)
    run.close()
    return {
        "rounds": rounds,
        "per_round": {
            event.key: {
                "count": event.count / rounds,
                "self_cpu_ms": event.self_cpu_time_total / 1e3 / rounds,
                "self_device_ms": getattr(event, "self_device_time_total", 0.0) / 1e3 / rounds,
            }
            for event in profiler.key_averages()
        },
    }


class _Enough(Exception):
    """Raised from the target's forward hook to end the official loop once it ran the rounds needed."""


def time_official(
    official: nn.Module,
    target: PreTrainedModel,
    prompt: list[int],
    rounds: int,
    warmup: int,
    times: MethodTimes,
) -> None:
    """Run the official ``dflash_generate`` for ``warmup + rounds`` rounds; add the timed ones to ``times``.

    A forward hook on the target clocks the end of each forward (the prefill, then one verification
    per round) and keeps its inputs: a round's root position and block give its committed tokens once
    the next round starts, so the loop runs one verification more than it times. Its length limit is
    set beyond reach, so its last rounds never shrink their block.
    """
    from dflash.model import dflash_generate

    device = target.device
    forwards: list[tuple[float, torch.Tensor, torch.Tensor]] = []
    needed = warmup + rounds + 2

    def observe(module, args, kwargs, output) -> None:
        forwards.append((_clock(device), args[0] if args else kwargs["input_ids"], kwargs["position_ids"]))
        if len(forwards) == needed:
            raise _Enough

    handle = target.register_forward_hook(observe, with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # it passes past_key_values, since renamed
            ids = torch.tensor([prompt], device=device)
            dflash_generate(official, target, ids, needed * official.block_size, None)
    except _Enough:
        pass
    finally:
        handle.remove()
    if len(forwards) < needed:
        raise RuntimeError(f"the official loop stopped after {len(forwards)} forwards, {needed} were needed")
    timed = slice(warmup, warmup + rounds)  # rounds are numbered from 1: forward 0 is the prefill
    ends = [end for end, _, _ in forwards]
    starts = [int(positions[0, 0]) for _, _, positions in forwards]
    blocks = [block[0].tolist() for _, block, _ in forwards]
    committed = [b - a for a, b in itertools.pairwise(starts[1:])]
    times.round_ms += [1e3 * (b - a) for a, b in itertools.pairwise(ends)][timed]
    times.accepted += committed[timed]
    times.verified += [len(block) for block in blocks[1:]][timed]
    tokens = [token for block, n in zip(blocks[1:], committed, strict=False) for token in block[:n]]
    times.tokens = times.tokens or [*tokens, blocks[-1][0]]


@dataclass
class Models:
    """One set of random weights, in our drafter and (when the package runs) the official one."""

    target: PreTrainedModel
    drafter: DFlashDraftModel
    official: nn.Module | None
    official_error: str | None
    """Why there is no official model (None: there is one, or none was asked for)."""
    shapes: dict
    """Both models' configurations and parameter counts, as built."""


def build_models(settings: Settings, log: Callable[[str], None]) -> Models:
    """The target, our drafter and the official one on the settings' device, acceptance fixed."""
    begin = time.perf_counter()
    shape = SHAPES[settings.shape]
    target = build_target(shape, torch.device(settings.device), DTYPES[settings.dtype], settings.seed)
    log(
        f"target: random Qwen3 of the {settings.shape} shape, {count_text(parameter_count(target))} "
        f"parameters, built on {settings.device} in {settings.dtype} in {time.perf_counter() - begin:.1f} s"
    )
    drafter = build_drafter(shape, target, settings.seed)
    shapes = shapes_record(shape, target, drafter)
    if settings.acceptance == "full":
        head = target.get_output_embeddings()  # a new parameter: a tied embedding keeps its weights
        head.weight = nn.Parameter(torch.zeros_like(head.weight), requires_grad=False)
    official, error = None, None
    if settings.official:
        try:
            official = official_drafter(drafter)
        except (ImportError, RuntimeError) as failure:  # no package, or a layout it does not load
            error = f"{type(failure).__name__}: {failure}"
    log(
        f"drafter: DFlash, {shape.draft_layers} layers, block {shape.block_size}, taps "
        f"{list(shape.target_layer_ids)}, {count_text(parameter_count(drafter))} parameters; official "
        f"loop: {'same weights loaded' if official is not None else error or 'not asked for'}"
    )
    return Models(target, drafter, official, error, shapes)


def time_methods(
    settings: Settings,
    models: Models,
    methods: dict[str, SpeculativeEngine],
    prompt: list[int],
    log: Callable[[str], None],
) -> dict[str, MethodTimes]:
    """Every method's rounds, methods interleaved per repeat. An official loop that fails (a package
    version it cannot run with) is dropped, its error kept in ``models``; our failures raise."""
    times = {name: MethodTimes(name, "diffdraft") for name in methods}
    if models.official is not None:
        times[OFFICIAL] = MethodTimes(OFFICIAL, f"dflash {_version('dflash')}")
    rounds, warmup = settings.rounds, settings.warmup
    for repeat in range(settings.repeats):
        for name, record in list(times.items()):
            if name != OFFICIAL:
                time_engine(methods[name], prompt, rounds, warmup, record)
            else:
                try:
                    time_official(models.official, models.target, prompt, rounds, warmup, record)
                except Exception as failure:
                    models.official_error = f"{type(failure).__name__}: {failure}"
                    log(f"official loop failed: {models.official_error}")
                    del times[OFFICIAL]
                    continue
            log(f"repeat {repeat + 1}/{settings.repeats} {_progress_line(record)}")
    return times


def run_benchmark(settings: Settings, command: str = "", log: Callable[[str], None] = print) -> dict:
    """Build the models, time every method, and return every number (JSON-ready) with its context;
    ``command``: the command line that asked for it, recorded with the results."""
    begin = time.perf_counter()
    shape = SHAPES[settings.shape]
    context = settings.context or shape.context
    with attention_backends(settings.sdpa_backends):
        models = build_models(settings, log)
        target = TargetModel(models.target, cuda_graphs=settings.cuda_graphs)
        methods = engines(target, DFlashDrafter(models.drafter, target), settings.budgets)
        prompt = random_prompt(shape, context, settings.seed)
        times = time_methods(settings, models, methods, prompt, log)
        profiles = {}
        if settings.profile:
            largest = [f"ddtree:{max(settings.budgets)}"] if settings.budgets else []
            rounds = min(settings.rounds, 8)
            for name in ["chain", *largest]:
                profiles[name] = profile_rounds(methods[name], prompt, rounds, settings.warmup)
                log(f"profiled {name}")
    reference, loop = times[REFERENCE], times.get(OFFICIAL)
    return {
        "settings": {
            **asdict(settings),
            "context": context,
            "budgets": list(settings.budgets),
            "sdpa_backends": list(settings.sdpa_backends),
        },
        "environment": {**environment(target.device, target.dtype), "command": command},
        "shapes": models.shapes,
        "official_error": models.official_error,
        "methods": [record.summary(reference, loop) for record in times.values()],
        "raw": {
            name: {key: getattr(t, key) for key in ("round_ms", "accepted", "verified", "stage_ms")}
            for name, t in times.items()
        },
        "tokens": {name: t.tokens for name, t in times.items()},
        "profiles": profiles,
        "seconds": time.perf_counter() - begin,
    }


def attention_backends(names: Sequence[str]) -> contextlib.AbstractContextManager:
    """Restrict ``F.scaled_dot_product_attention`` to the named backends (none named: no restriction);
    an unknown name is an error that lists the known ones."""
    if not names:
        return contextlib.nullcontext()
    known = {name.lower(): backend for name, backend in SDPBackend.__members__.items() if name != "ERROR"}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown attention backend(s) {unknown}; choose from {sorted(known)}")
    return sdpa_kernel([known[name] for name in names])


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """What the timings were taken on."""
    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else cpu_name(),
        "cuda_max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "dflash": _version("dflash"),
        "diffdraft": _version("diffdraft"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def shapes_record(shape: SyntheticShape, target: PreTrainedModel, drafter: DFlashDraftModel) -> dict:
    """Both models' configurations and parameter counts, for the report's header."""
    return {
        "target": {**shape.target, "parameters": parameter_count(target)},
        "drafter": {
            "layers": shape.draft_layers,
            "block_size": shape.block_size,
            "target_layer_ids": list(shape.target_layer_ids),
            "mask_token_id": shape.mask_token_id,
            "intermediate_size": drafter.config.intermediate_size,
            "parameters": parameter_count(drafter),
        },
    }


def _clock(device: torch.device) -> float:
    """Wall time once the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _matching(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's (the shorter length when one is a prefix)."""
    position = first_divergence(reference, tokens)
    return len(tokens) if position is None else position


def _progress_line(times: MethodTimes) -> str:
    stages = ", ".join(f"{s} {statistics.fmean(ms):.2f}" for s, ms in times.stage_ms.items())
    return (
        f"{times.method:<11} {statistics.fmean(times.verified):5.1f} tokens/round  "
        f"tau {statistics.fmean(times.accepted):.2f}  round {statistics.median(times.round_ms):7.2f} ms"
        + (f"  ({stages})" if stages else "")
    )


def count_text(n: int) -> str:
    """A parameter count in billions or millions."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
