"""``diffdraft train``: ``prompts`` (read, clean, write prompts) and ``regenerate`` (responses by the target).

Every sub-command also takes ``--config FILE`` (JSON, or TOML by its ``.toml`` suffix) so a whole
pipeline can live in one file; flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import distributed as dist
from transformers import PreTrainedTokenizerBase

from diffdraft.data.prompts import (
    SHAREGPT,
    Prompt,
    decontaminate,
    drop_duplicates,
    eval_texts,
    read_sources,
    write_prompts,
)
from diffdraft.data.samples import sharegpt_held_out
from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.drafters.families import DraftModel, family_of, variants
from diffdraft.drafters.mask_token import pick_mask_token
from diffdraft.errors import InvalidRequestError
from diffdraft.ngram.shipped import load_ngram
from diffdraft.target.loading import default_device, end_token_ids, fastest_dtype, load_target
from diffdraft.target.model import TargetModel
from diffdraft.train.config import COMPUTE_DTYPES, INIT_LAYERS, LABELS, TrainConfig
from diffdraft.train.dataset import load_responses
from diffdraft.train.dflash_seed import dflash_from_dflare
from diffdraft.train.draft_vocab import coverage
from diffdraft.train.evaluate import DartTrees, evaluate_drafter
from diffdraft.train.features import capture_features
from diffdraft.train.mask_token import refuse_mask_in_data
from diffdraft.train.objectives import recipe_for, recipe_for_variant
from diffdraft.train.pack import (
    check_out_path,
    check_packed_for,
    conversation_openings,
    drop_same_openings,
    is_packed,
    read_packed,
    reply_samples,
    response_samples,
    write_packed,
)
from diffdraft.train.plots import plot_learning_curve, plot_training_curves
from diffdraft.train.regenerate import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PROMPT_TOKENS,
    RegenerateReport,
    regenerate,
)
from diffdraft.train.run_checkpoints import saved_checkpoints, tokens_seen_at
from diffdraft.train.source_replies import write_source_replies
from diffdraft.train.trainer import Trainer
from diffdraft.util.fingerprint import tokenizer_fingerprint
from diffdraft.util.heap import keep_freed_memory


def load_config(path: str | Path) -> dict:
    """Option values from a JSON or (``.toml`` suffix) TOML file, keyed ``batch_size`` or ``batch-size``."""
    path = Path(path)
    is_toml = path.suffix.lower() == ".toml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read config file {path} ({error.strerror})") from error
    try:
        if is_toml:
            import tomllib  # Python 3.11+; older Pythons can use a JSON config

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ImportError as error:
        raise ValueError(f"{path}: TOML config files need Python 3.11 or later; use JSON instead") from error
    except ValueError as error:  # JSONDecodeError and TOMLDecodeError are both ValueErrors
        raise ValueError(f"{path} is not valid {'TOML' if is_toml else 'JSON'}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f'{path} must hold an object of option values, e.g. {{"batch_size": 8}}')
    return data


class ConfigArgumentParser(argparse.ArgumentParser):
    """An argument parser whose option values may also come from ``--config FILE``; flags win.

    Top-level keys apply to every sub-command that has an option of that name (others ignore them),
    so one file serves the whole pipeline; a table named after the sub-command (``[regenerate]``)
    applies to it alone, overrides the top level, and must name only its options.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--config", metavar="FILE", help="JSON or TOML file of option values; flags override it"
        )

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        only_config = argparse.ArgumentParser(add_help=False)
        only_config.add_argument("--config")
        config_path = only_config.parse_known_args(args)[0].config
        if config_path:
            # Values already on the namespace are kept by argparse, so config values become the
            # defaults and flags parsed afterwards replace them.
            namespace = namespace or argparse.Namespace()
            for dest, value in self._config_values(config_path).items():
                setattr(namespace, dest, value)
        return super().parse_known_args(args, namespace)

    def _config_values(self, path: str) -> dict[str, object]:
        try:
            data = load_config(path)
        except ValueError as error:
            self.error(str(error))
        command = self.prog.rsplit(" ", 1)[-1]
        actions = {action.dest: action for action in self._actions if action.dest not in ("help", "config")}
        section = data.get(command, {})
        if not isinstance(section, dict):
            self.error(f"{path}: '{command}' must be a table of option values")
        values = {}
        for key, value in data.items():
            if not isinstance(value, dict) and key.replace("-", "_") in actions:
                values[key.replace("-", "_")] = value
        for key, value in section.items():
            if key.replace("-", "_") not in actions:
                self.error(f"{path}: [{command}] sets {key!r}, which is not an option of '{command}'")
            values[key.replace("-", "_")] = value
        for dest, value in values.items():
            action = actions[dest]
            if action.nargs in ("+", "*") and isinstance(value, str):
                values[dest] = value = [value]
            if isinstance(value, str) and action.type is not None:
                try:
                    values[dest] = value = action.type(value)
                except ValueError:
                    self.error(f"{path}: {dest} = {value!r} is not a valid {action.type.__name__}")
            if action.choices is not None and value not in action.choices:
                choices = ", ".join(map(str, action.choices))
                self.error(f"{path}: {dest} must be one of {choices}; got {value!r}")
            # A required option the config supplies is no longer missing from the command line.
            action.required = False
        return values


def add_train_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``diffdraft train`` and its sub-commands on the top-level parser's subparsers."""
    train = subparsers.add_parser("train", help="build training data for a drafter and train it")
    steps = train.add_subparsers(dest="train_command", required=True, parser_class=ConfigArgumentParser)

    prompts = steps.add_parser(
        "prompts", help="read prompts, drop duplicates and eval overlaps, and write them as jsonl"
    )
    _add_source_options(prompts)
    prompts.add_argument("--out", required=True, help="prompts jsonl to write ({id, messages} per line)")

    regen = steps.add_parser(
        "regenerate",
        help="generate each prompt's response with the target (resumable: rerun the same command)",
    )
    _add_source_options(regen)
    regen.add_argument(
        "--out", required=True, help="responses jsonl to append to; ids already in it are skipped"
    )
    regen.add_argument("--target", default="default", help="model directory, .gguf file or 'default'")
    regen.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default=DEFAULT_DTYPE, help="default: %(default)s"
    )
    regen.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    regen.add_argument(
        "--temperature",
        type=float,
        default=0.6,
        help="sampling temperature, 0 = greedy (default: %(default)s)",
    )
    regen.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    regen.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="default: %(default)s"
    )
    regen.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="longer prompts are skipped (default: %(default)s)",
    )
    regen.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="default: %(default)s, fastest on a 2-core CPU",
    )
    regen.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    regen.add_argument(
        "--source-replies",
        action="store_true",
        help="generate nothing: tokenize each source's own assistant reply instead (EAGLE-1's "
        "fixed-dataset route; seconds instead of hours, but not the target's own answers)",
    )
    _add_pack_parser(steps)
    _add_fit_parser(steps)
    _add_capture_parser(steps)
    _add_eval_parser(steps)
    return train


DEFAULT_MAX_LENGTH = 1024
FASTEST = "bfloat16 where the device computes it natively (CUDA, CPUs with AVX-512 BF16 or AMX), else float32"


def _add_data_options(parser: argparse.ArgumentParser, fit: bool = False) -> None:
    parser.add_argument(
        "--data",
        required=True,
        help="responses jsonl written by `diffdraft train regenerate`, or a .safetensors file written by "
        "`diffdraft train pack`",
    )
    parser.add_argument("--target", default="default", help="model directory, .gguf file or 'default'")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None if fit else "float32",
        help=f"target dtype (default: {FASTEST})" if fit else "target dtype (default: %(default)s)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help=f"tokens per sequence (default: a packed file's own, else {DEFAULT_MAX_LENGTH})",
    )
    parser.add_argument(
        "--held-out",
        type=int,
        default=32,
        help="last N samples (by id order) are never trained on; eval uses them (default: %(default)s)",
    )


def _add_pack_parser(steps: argparse._SubParsersAction) -> None:
    pack = steps.add_parser(
        "pack",
        help="tokenize training samples once into one compact .safetensors file that `train fit --data` "
        "reads with no tokenizer work (a lent GPU's calls carry 64 MiB)",
    )
    _add_source_options(pack)
    pack.add_argument("--out", required=True, help="packed file to write (.safetensors)")
    pack.add_argument(
        "--target", default="default", help="model directory, .gguf file or 'default' (its chat template)"
    )
    pack.add_argument(
        "--max-length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        help="tokens per sequence, cut as `train fit` cuts them; fit trains at this length "
        "(default: %(default)s)",
    )
    pack.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="longer replies are cut here (default: %(default)s)",
    )
    pack.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help="longer prompts are skipped (default: %(default)s)",
    )
    pack.add_argument(
        "--held-out-file",
        nargs="+",
        default=[],
        metavar="FILE",
        help="also drop every conversation that opens with the same message as one in FILE (an eval's "
        "held-out prompts: a short opening escapes the n-gram check)",
    )
    pack.add_argument(
        "--responses",
        nargs="+",
        default=None,
        metavar="FILE",
        help="pack these `train regenerate` outputs (e.g. the target's own answers) instead of the "
        "sources' replies; they are packed as they are (no source options apply)",
    )


def _add_fit_parser(steps: argparse._SubParsersAction) -> None:
    fit = steps.add_parser(
        "fit",
        help="train a DFlash/DFlare, DFlash2, DSpark, DART or DEER drafter (resumes from the latest "
        "checkpoint)",
    )
    _add_data_options(fit, fit=True)
    fit.add_argument("--output-dir", required=True, help="checkpoints, metrics.jsonl, curves.png, final/")
    fit.add_argument("--feature-cache", default=None, help="directory from `train capture` (default: online)")
    fit.add_argument(
        "--init-drafter",
        default=None,
        help="start from this drafter's weights (fine-tune it, e.g. on other data); its config decides "
        "the architecture, block size, taps and draft vocabulary",
    )
    defaults = TrainConfig(output_dir="")
    # every plain TrainConfig field becomes a flag with the dataclass default: one source of truth
    declared_elsewhere = {
        "variant",
        "output_dir",
        "max_length",
        "target_layer_ids",
        "mask_token_id",
        "gamma_0",
        "gamma_max",
        "intermediate_size",
        "compute_dtype",
        "labels",
        "init_layers",
        "tokenizer_fingerprint",
    }
    for name, value in asdict(defaults).items():
        if name not in declared_elsewhere:
            flag = f"--{name.replace('_', '-')}"
            fit.add_argument(flag, type=type(value), default=value, help="default: %(default)s")
    fit.add_argument(
        "--variant",
        choices=variants(),
        default=None,
        help="dflash / dflare: block-diffusion drafters; dart: DART's one-layer shifted-logits drafter "
        "(--draft-length masks, annealed KL); deer: DEER's standalone diffusion LM (--num-layers of the "
        "target's first layers unless --init-drafter, e.g. from `diffdraft deer init`; --stage 1|2); "
        "dflash2: DFlash + block convs and a candidate selector (--conv-kernel-size, --conv-group-size, "
        "--selector-rank, --selector-top-k); dspark: Qwen3 DSpark, the anchor row drafting too, with a "
        "Markov head (--markov-rank) and a confidence head; both in the layout vLLM loads; "
        f"default: {defaults.variant}, or the --init-drafter's own; dflash with a DFlare --init-drafter "
        "seeds a DFlash from it (one that llama.cpp, vLLM and SGLang run)",
    )
    fit.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="target layers to tap, DFlash ids (default: dflash 5, dflare 9 spread evenly from layer 1 to "
        "L-3 of the target's L, whatever --num-layers; dart: EAGLE-3's 3)",
    )
    fit.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="default: the tokenizer's mask token, else the first unused embedding row, else an unused "
        "control token (deer refuses an id the training data contains)",
    )
    fit.add_argument(
        "--gamma-0",
        type=float,
        default=None,
        help="loss position weighting: dflash/dflare/dflash2 exp(-(k-1)/gamma), default 4.5; dspark "
        "exp(-(d-1)/gamma) per depth d, default 4.0; dart gamma^(t-1), "
        "default 0.6; deer stage 2's alpha^(R-i), default 1.01",
    )
    fit.add_argument(
        "--gamma-max", type=float, default=None, help="default: gamma-0 + epochs - 1 (dart: gamma-0)"
    )
    fit.add_argument(
        "--intermediate-size", type=int, default=None, help="draft MLP width (default: target's)"
    )
    fit.add_argument(
        "--labels",
        choices=LABELS,
        default=defaults.labels,
        help="target = distil the target (KL to its own next-token distribution at every position, "
        "from the forward that gives the features); tokens = cross-entropy on the data's tokens; "
        "default: %(default)s",
    )
    fit.add_argument(
        "--init-layers",
        choices=INIT_LAYERS,
        default=defaults.init_layers,
        help="target = draft layers start as copies of the target's last layers; default: %(default)s",
    )
    fit.add_argument(
        "--compute-dtype",
        choices=sorted(COMPUTE_DTYPES),
        default=None,
        help="bfloat16 = mixed precision (drafter matmuls in bf16, float32 weights and optimizer); "
        f"default: {FASTEST}",
    )


def _add_capture_parser(steps: argparse._SubParsersAction) -> None:
    capture = steps.add_parser("capture", help="cache target hidden states to disk once (resumable)")
    _add_data_options(capture)
    capture.add_argument("--feature-cache", required=True, help="directory for the sharded safetensors cache")
    capture.add_argument("--target-layer-ids", type=int, nargs="+", required=True, help="DFlash layer ids")


def _add_eval_parser(steps: argparse._SubParsersAction) -> None:
    evaluate = steps.add_parser("eval", help="per-position accuracy and chain/DDTree tau of a drafter")
    _add_data_options(evaluate)
    evaluate.add_argument(
        "--drafter",
        required=True,
        help="drafter checkpoint directory, or a `train fit` output directory: every checkpoint "
        "in it is evaluated and --out gets a learning curve (tau vs training tokens, JSON + PNG)",
    )
    evaluate.add_argument("--budgets", type=int, nargs="+", default=[8, 32, 128], help="DDTree budgets")
    evaluate.add_argument(
        "--ngram",
        default=None,
        help="also measure tau of DART's tree (dart-B for each budget B) with this N-gram trie: a "
        "directory, 'default' or 'none' for the tree without the N-gram term (default: not measured)",
    )
    evaluate.add_argument("--max-new-tokens", type=int, default=64, help="per held-out prompt (default: 64)")
    evaluate.add_argument("--out", default=None, help="also write the result as JSON here")


def _add_source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        nargs="+",
        default=[SHAREGPT],
        metavar="SRC",
        help=f"'{SHAREGPT}' (built in), jsonl or JSON array files, datasets directories (default {SHAREGPT})",
    )
    parser.add_argument(
        "--decontaminate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop prompts sharing a word n-gram with HumanEval or MT-Bench (default: on)",
    )
    parser.add_argument("--ngram", type=int, default=13, help="n-gram size for decontamination (default: 13)")
    parser.add_argument(
        "--all-turns",
        action="store_true",
        help="a prompt for every user turn of a conversation, with the turns before it, not only the "
        "first (ShareGPT: 3.5x the reply text); regenerate drops a history's oldest exchanges while "
        "the prompt is over --max-prompt-tokens",
    )
    parser.add_argument("--limit", type=int, default=None, help="keep only the first N prompts")


def run_train(args: argparse.Namespace) -> None:
    """Run the ``diffdraft train`` sub-command that ``args`` names."""
    commands = {
        "prompts": _run_prompts,
        "regenerate": _run_regenerate,
        "pack": _run_pack,
        "fit": _run_fit,
        "capture": _run_capture,
        "eval": _run_eval,
    }
    commands[args.train_command](args)


def _load_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.limit is not None and args.limit < 1:
        raise InvalidRequestError(f"--limit must be at least 1, got {args.limit}")
    prompts, reports = read_sources(args.source, args.all_turns)
    for report in reports:
        print(report.summary(), flush=True)
    prompts, duplicates = drop_duplicates(prompts)
    print(f"dropped {duplicates} duplicate prompts", flush=True)
    if args.decontaminate:
        # The bench's ShareGPT slice is an eval set too: skip its prompts and anything copying them.
        held_out = sharegpt_held_out()
        held_out_ids = {sample.id for sample in held_out}
        kept = [prompt for prompt in prompts if prompt.conversation_id not in held_out_ids]
        print(f"dropped {len(prompts) - len(kept)} prompts of the bench's ShareGPT slice", flush=True)
        texts = eval_texts() + [message["content"] for sample in held_out for message in sample.messages]
        prompts, dropped = decontaminate(kept, texts, args.ngram)
        print(
            f"dropped {dropped} prompts sharing a {args.ngram}-gram with HumanEval, MT-Bench or that slice",
            flush=True,
        )
    return prompts[: args.limit]


def _run_prompts(args: argparse.Namespace) -> None:
    count = write_prompts(_load_prompts(args), args.out)
    print(f"wrote {count} prompts to {args.out}")


def _run_regenerate(args: argparse.Namespace) -> None:
    prompts = _load_prompts(args)
    if args.source_replies:
        print(f"tokenizing the sources' own replies to {len(prompts)} prompts into {args.out}", flush=True)
        report = write_source_replies(
            args.target, prompts, args.out, args.max_new_tokens, args.max_prompt_tokens
        )
        print(report.summary())
        return
    print(f"regenerating responses for {len(prompts)} prompts into {args.out}", flush=True)
    try:
        report = regenerate(
            args.target,
            prompts,
            args.out,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished samples are in {args.out}; rerun the same command to resume")
        raise SystemExit(130) from None
    print(report.summary())


def _run_pack(args: argparse.Namespace) -> None:
    """Tokenize here what a lent GPU will train on: its minutes and its 64 MiB calls are too dear."""
    if args.max_length < 2:
        raise InvalidRequestError(f"--max-length must be at least 2, got {args.max_length}")
    if args.responses and args.held_out_file:
        raise InvalidRequestError(
            "--held-out-file filters the sources' prompts; --responses files are packed as they are "
            "(filter them when they are made)"
        )
    check_out_path(args.out)
    loaded = load_target(args.target, "float32", "cpu")
    if args.responses:
        samples = response_samples(args.responses, args.max_length)
        made_from = {"responses": args.responses}
    else:
        prompts = _load_prompts(args)
        if args.held_out_file:
            openings = set().union(*(conversation_openings(path) for path in args.held_out_file))
            prompts, dropped = drop_same_openings(prompts, openings)
            print(f"dropped {dropped} prompts whose conversation opens as one in --held-out-file", flush=True)
        report = RegenerateReport()
        samples = reply_samples(
            loaded, prompts, args.max_new_tokens, args.max_prompt_tokens, args.max_length, report
        )
        print(
            f"{report.written} replies tokenized ({report.generated_tokens} tokens), {report.too_long} "
            f"prompts skipped as too long, {len(prompts) - report.written - report.too_long} without a reply",
            flush=True,
        )
        made_from = {
            key: getattr(args, key)
            for key in ("source", "all_turns", "decontaminate", "ngram", "limit", "held_out_file")
        }
        made_from |= {"max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    info = write_packed(
        samples, args.out, args.max_length, tokenizer_fingerprint(loaded.tokenizer), made_from
    )
    size = Path(args.out).stat().st_size / 2**20
    print(f"packed {info.samples} samples, {info.tokens} tokens ({size:.1f} MiB) into {args.out}")


def _split(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, for_eval: bool = False
) -> tuple[list, list]:
    """Training and held-out samples: the held-out ones are the last by id, a stable choice.

    Evaluation may hold out the whole file (a file of held-out samples only). A packed file brings
    its own length (``--max-length`` may only repeat it) and must come from the target's tokenizer."""
    if is_packed(args.data):
        samples, info = read_packed(args.data)
        args.max_length = args.max_length or info.max_length
        check_packed_for(info, args.data, args.max_length, tokenizer_fingerprint(tokenizer))
    else:
        args.max_length = args.max_length or DEFAULT_MAX_LENGTH
        samples = load_responses(args.data, args.max_length)
    samples = sorted(samples, key=lambda s: s.sample_id)
    if for_eval and not 0 < args.held_out <= len(samples):
        raise InvalidRequestError(
            f"--held-out {args.held_out}: eval needs between 1 and the {len(samples)} samples of {args.data}"
        )
    if not for_eval and args.held_out >= len(samples):
        raise InvalidRequestError(
            f"--held-out {args.held_out} leaves nothing to train on ({len(samples)} samples)"
        )
    cut = len(samples) - args.held_out
    return samples[:cut], samples[cut:]


def process_group_backend(device: torch.device, gpus: int, local_processes: int) -> str:
    """NCCL when every local process has a GPU of its own; gloo on CPUs and when several processes
    share a GPU (NCCL refuses two ranks on one device; a trainer works one sequence at a time, so
    several can share a GPU: v7 trained with eight on one H100)."""
    return "nccl" if device.type == "cuda" and gpus >= local_processes else "gloo"


def _join_process_group(device: str | None) -> str | None:
    """Join torchrun's process group; return this rank's device (GPU LOCAL_RANK mod the GPUs present
    when ``device`` names no index: otherwise every rank would land on GPU 0)."""
    chosen = default_device(device)
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(chosen)
        device = str(chosen)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if chosen.type == "cuda" else 0
    dist.init_process_group(process_group_backend(chosen, gpus, local_processes))
    return device


def _initial_drafter(args: argparse.Namespace) -> DraftModel | None:
    """The ``--init-drafter`` to start from, seeded as DFlash when ``--variant dflash`` asks that of a
    DFlare; fills in ``args.variant`` (the drafter's own when not given)."""
    if not args.init_drafter:
        args.variant = args.variant or DFLASH
        return None
    initial = load_draft_model(args.init_drafter)
    family = family_of(initial)
    if not family.trains:
        raise InvalidRequestError(
            f"--init-drafter {args.init_drafter} is a {family.name} drafter, which diffdraft drafts with "
            f"but does not train; start from a drafter of: {', '.join(variants())}"
        )
    own = getattr(initial, "variant", None) or family.variants[0]
    if args.variant in (None, own):
        args.variant = own
        return initial
    if (own, args.variant) == (DFLARE, DFLASH):
        return dflash_from_dflare(initial)
    raise InvalidRequestError(
        f"--init-drafter {args.init_drafter} is a {own} drafter and cannot start a {args.variant} one "
        f"(only a DFlare can seed a DFlash); drop --variant to fine-tune it as {own}"
    )


def _run_fit(args: argparse.Namespace) -> None:
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        args.device = _join_process_group(args.device)
    try:
        device = default_device(args.device)
        if device.type == "cpu":
            keep_freed_memory()  # the steps' tensors live in host memory: reuse it, don't fault it in
        fastest = fastest_dtype(device)
        args.dtype, args.compute_dtype = args.dtype or fastest, args.compute_dtype or fastest
        loaded = load_target(args.target, dtype=args.dtype, device=args.device)
        train, _ = _split(args, loaded.tokenizer)
        initial = _initial_drafter(args)
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
        config.tokenizer_fingerprint = tokenizer_fingerprint(loaded.tokenizer)
        recipe = recipe_for_variant(config.variant) if initial is None else recipe_for(initial)
        check_tokenizer = None if initial is None else family_of(initial).check_tokenizer
        if check_tokenizer is not None:
            check_tokenizer(initial, loaded.tokenizer)  # equal vocab sizes can still mean other text
        mask = None
        if initial is not None:
            config.mask_token_id = getattr(initial, "mask_token_id", None)  # DART drafters have none
        elif config.mask_token_id is None and recipe.needs_mask_token:
            embedding = loaded.model.get_input_embeddings().weight
            mask = pick_mask_token(loaded.tokenizer, end_token_ids(loaded.model, loaded.tokenizer), embedding)
            config.mask_token_id = mask.token_id
        if recipe.reads_mask_as_text:
            refuse_mask_in_data(train, config.mask_token_id)
        trainer = Trainer(
            config, TargetModel(loaded.model), train, feature_cache=args.feature_cache, drafter=initial
        )
        if trainer.rank == 0:
            steps = trainer.total_steps
            print(f"training on {len(train)} sequences ({args.held_out} held out), {steps} steps")
            print(f"precision: target {args.dtype}, drafter compute {args.compute_dtype}")
            if mask is not None:
                print(f"mask token: {mask.token_id} ({mask.reason})")
            if args.feature_cache:
                cached = sum(s.sample_id in trainer.features.shard_of for s in train)
                print(f"target features: {cached} sequences cached, {len(train) - cached} computed online")
            vocab = trainer.drafter.draft_vocab
            if vocab is not None:
                share = coverage(train, vocab.cpu(), trainer.target.vocab_size)
                print(f"draft vocabulary: {vocab.shape[0]} tokens, {share:.1%} of training response tokens")
        trainer.train()
        if trainer.rank == 0:
            plot_training_curves(trainer.metrics_file, trainer.output_dir / "curves.png")
            if trainer.state.step == trainer.total_steps:
                print(f"drafter written to {trainer.output_dir / 'final'}")
            else:  # stopped by --max-minutes: only the checkpoint exists
                print(
                    f"no final drafter yet: step {trainer.state.step} of {trainer.total_steps} is in "
                    f"{trainer.output_dir / f'checkpoint-{trainer.state.step}'}; run the same command "
                    "again to finish"
                )
    finally:
        if distributed:
            dist.destroy_process_group()


def _run_capture(args: argparse.Namespace) -> None:
    loaded = load_target(args.target, dtype=args.dtype, device=args.device)
    train, _ = _split(args, loaded.tokenizer)
    captured = capture_features(
        TargetModel(loaded.model),
        args.target_layer_ids,
        ((s.sample_id, s.token_ids) for s in train),
        args.feature_cache,
        total=len(train),
    )
    print(f"captured {captured} new sequences into {args.feature_cache}")


def _run_eval(args: argparse.Namespace) -> None:
    """One checkpoint, or every checkpoint of a run directory as a learning curve (tau vs tokens). A run
    directory's training states are read (never unpickled beyond tensors and plain values) before
    anything loads, so one that is refused costs nothing."""
    checkpoints = saved_checkpoints(Path(args.drafter))
    tokens_seen = [tokens_seen_at(c) for c in checkpoints]
    loaded = load_target(args.target, dtype=args.dtype, device=args.device)
    _, held_out = _split(args, loaded.tokenizer, for_eval=True)
    target = TargetModel(loaded.model)
    dart = None
    if args.ngram is not None:
        dart = DartTrees(load_ngram(args.ngram, loaded.tokenizer))
    if not checkpoints:
        result = evaluate_drafter(
            load_draft_model(args.drafter), target, held_out, tuple(args.budgets), args.max_new_tokens, dart
        ).to_dict()
    else:
        print(f"learning curve: evaluating {len(checkpoints)} checkpoints of {args.drafter}", flush=True)
        result = {"learning_curve": []}
        for checkpoint, tokens in zip(checkpoints, tokens_seen, strict=True):
            evaluation = evaluate_drafter(
                load_draft_model(checkpoint), target, held_out, tuple(args.budgets), args.max_new_tokens, dart
            )
            point = {"checkpoint": checkpoint.name, "tokens_seen": tokens}
            result["learning_curve"].append(point | evaluation.to_dict())
            print(json.dumps(result["learning_curve"][-1]), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        if checkpoints:
            plot_learning_curve(result["learning_curve"], Path(args.out).with_suffix(".png"))
