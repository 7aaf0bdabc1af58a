"""The benchmark loop: every method on every prompt, interleaved, timed and checked against plain AR.

Methods run back to back on each prompt (in an order that rotates from prompt to prompt), so drift
of the machine (thermal state, other jobs) hits all of them alike. Every method is warmed up before
any timing. A follow-up turn is asked after the reference (plain AR) reply, so all methods see the
same prompt tokens on every turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from diffdraft.bench.journal import Journal
from diffdraft.bench.lossless import LosslessChecker
from diffdraft.bench.methods import REFERENCE, Completion, MethodRunner, MethodSpec, Request
from diffdraft.bench.records import Record, TurnKey
from diffdraft.data.samples import Sample
from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.chat import encode_chat, encode_prompt
from diffdraft.util.progress import progress_bar


@dataclass
class BenchOptions:
    max_new_tokens: int = 256
    temperatures: Sequence[float] = (0.0,)
    repeats: int = 1
    seed: int = 0
    """Repeat r of a sampled run uses seed ``seed + r`` for every method."""
    warmup_tokens: int = 16
    progress: bool = True


@dataclass
class BenchRun:
    records: list[Record] = field(default_factory=list)

    @property
    def violations(self) -> list[Record]:
        """Divergences no near-tie explains: losslessness bugs."""
        return [r for r in self.records if r.divergence is not None and not r.divergence["explained"]]


def run_benchmark(
    runners: Sequence[MethodRunner],
    samples: Sequence[Sample],
    tokenizer: PreTrainedTokenizerBase,
    checker: LosslessChecker,
    options: BenchOptions,
    journal: Journal | None = None,
) -> BenchRun:
    """Run every method on every sample turn; the plain AR runner must be among ``runners``.

    Turns the ``journal`` holds from an interrupted run are replayed, not generated again.
    """
    reference = next((r for r in runners if r.spec == MethodSpec(REFERENCE)), None)
    if reference is None:
        raise InvalidRequestError("the benchmark needs plain AR (method 'ar') as the reference")
    if not samples:
        raise InvalidRequestError("no samples to benchmark")
    turns = sum(sample.turns for sample in samples)
    total = turns * options.repeats * len(runners) * len(options.temperatures)
    bar = progress_bar(total=total, desc="bench", unit="gen", disable=not options.progress)
    _warm_up(runners, encode_turn(tokenizer, samples[0], samples[0].messages), options, bar)
    run = BenchRun()
    rotation = 0
    for temperature in options.temperatures:
        for sample in samples:
            messages = list(sample.messages) if sample.messages is not None else None
            for turn in range(sample.turns):
                prompt = encode_turn(tokenizer, sample, messages)
                for repeat in range(options.repeats):
                    order = [*runners[rotation:], *runners[:rotation]]
                    rotation = (rotation + 1) % len(runners)
                    key: TurnKey = (sample.dataset, sample.id, turn, temperature, repeat)
                    records = journal.finished.get(key) if journal else None
                    if records is None:
                        records = _generate_turn(
                            runners, order, reference, prompt, key, options, checker, bar
                        )
                        if journal:
                            journal.append(records)
                    else:
                        bar.update(len(records))
                    run.records.extend(records)
                    reply = next(r.completion for r in records if r.method == REFERENCE)
                if turn + 1 < sample.turns:
                    text = tokenizer.decode(reply.token_ids, skip_special_tokens=True)
                    messages += [
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": sample.followups[turn]},
                    ]
    bar.close()
    return run


def _generate_turn(
    runners: Sequence[MethodRunner],
    order: Sequence[MethodRunner],
    reference: MethodRunner,
    prompt: list[int],
    key: TurnKey,
    options: BenchOptions,
    checker: LosslessChecker,
    bar: tqdm,
) -> list[Record]:
    """Every method on one prompt turn, in ``order``; records in ``runners`` order, checked against AR."""
    *_, temperature, repeat = key
    request = Request(prompt, options.max_new_tokens, temperature, seed=options.seed + repeat)
    done = {}
    for runner in order:
        bar.set_postfix_str(f"{key[0]} {runner.spec.label}", refresh=False)
        done[runner] = runner.generate(request)
        bar.update()
    records = []
    for runner in runners:
        record = Record(*key, runner.spec.label, len(prompt), done[runner])
        _check(record, runner, reference, done[reference], prompt, checker)
        records.append(record)
    return records


def _check(
    record: Record,
    runner: MethodRunner,
    reference: MethodRunner,
    base: Completion,
    prompt: list[int],
    checker: LosslessChecker,
) -> None:
    """Greedy outputs of the reference's dtype must equal plain AR's, up to explained near-ties."""
    if record.temperature == 0 and runner.dtype == reference.dtype and runner is not reference:
        record.compared = True
        divergence = checker.check(prompt, base.token_ids, record.completion.token_ids)
        record.divergence = divergence.to_dict() if divergence else None


def _warm_up(runners: Sequence[MethodRunner], prompt: list[int], options: BenchOptions, bar: tqdm) -> None:
    """One untimed short generation per method: first-call costs (allocation, kernel choice) stay out."""
    bar.set_postfix_str("warm-up", refresh=True)
    for runner in runners:
        runner.generate(Request(prompt, options.warmup_tokens, seed=options.seed))


def encode_turn(tokenizer: PreTrainedTokenizerBase, sample: Sample, messages: list[dict] | None) -> list[int]:
    if sample.prompt is not None:
        return encode_prompt(tokenizer, sample.prompt)
    return encode_chat(tokenizer, messages)
