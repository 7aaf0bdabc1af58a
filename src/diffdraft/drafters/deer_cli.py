"""``diffdraft deer``: ``init`` a DEER drafter from a causal LM's first layers, ``info`` on one.

``init`` only copies weights: the drafter is then trained (``diffdraft train fit --variant deer
--init-drafter DIR``). It writes into a temporary directory beside ``--out`` and renames it into place,
so a failed run leaves nothing behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffdraft.drafters.checkpoint import load_draft_model, save_draft_model
from diffdraft.drafters.deer_model import DEERDraftModel, deer_from_causal_lm
from diffdraft.drafters.mask_token import pick_mask_token
from diffdraft.errors import CheckpointError, InvalidRequestError
from diffdraft.target.default_model import MODEL_NAME
from diffdraft.target.loading import DTYPES, end_token_ids, load_target
from diffdraft.util.fingerprint import tokenizer_fingerprint
from diffdraft.util.staging import staged_directory

DEFAULT_BLOCK_SIZE = 16


def add_deer_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "deer", help="create or inspect a DEER drafter (a diffusion LM reading tokens)"
    )
    commands = parser.add_subparsers(dest="deer_command", required=True)

    init = commands.add_parser("init", help="build an untrained DEER drafter from a causal LM's first layers")
    init.add_argument(
        "--from",
        dest="base",
        required=True,
        metavar="MODEL",
        help="model directory, .gguf file or 'default': its embedding, first layers and head are copied",
    )
    init.add_argument(
        "--num-layers", type=int, required=True, metavar="N", help="how many of MODEL's layers to keep"
    )
    init.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    init.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="N",
        help=f"tokens drafted per forward (default: {DEFAULT_BLOCK_SIZE})",
    )
    init.add_argument(
        "--denoising-steps",
        type=int,
        default=1,
        metavar="S",
        help="forwards per draft: each later one shows the most confident tokens so far (default: 1)",
    )
    init.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        metavar="ID",
        help="token id of the mask rows (default: the tokenizer's mask token, else the first unused "
        "embedding row, else an unused control token)",
    )
    init.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights as saved (default: float32)",
    )
    init.add_argument("--force", action="store_true", help="replace whatever --out holds")

    info = commands.add_parser("info", help="print a DEER drafter's settings and provenance")
    info.add_argument("drafter", help="DEER checkpoint directory")
    return parser


def run_deer(args: argparse.Namespace) -> int:
    if args.deer_command == "init":
        _run_init(args)
    else:
        _run_info(args)
    return 0


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidRequestError(f"--out {out} is a file; pass a directory path for the drafter")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InvalidRequestError(
            f"--out {out} is not empty; choose another --out, or pass --force to replace its contents"
        )


def _run_init(args: argparse.Namespace) -> None:
    out = Path(args.out).expanduser()
    if args.block_size < 1:
        raise InvalidRequestError(f"--block-size must be at least 1, got {args.block_size}")
    if args.denoising_steps < 1:
        raise InvalidRequestError(f"--denoising-steps must be at least 1, got {args.denoising_steps}")
    _check_out_dir(out, args.force)  # before loading MODEL: refuse in a second, not after a load
    loaded = load_target(args.base, "float32", "cpu")
    initialized_from = f"{MODEL_NAME} (embedded default)" if args.base == "default" else args.base
    base = loaded.model.config.get_text_config()
    if not 1 <= args.num_layers <= base.num_hidden_layers:
        raise InvalidRequestError(
            f"--num-layers must be between 1 and {base.num_hidden_layers}, the layer count of "
            f"{initialized_from}; got {args.num_layers}"
        )
    mask_token_id = args.mask_token_id
    if mask_token_id is None:
        embedding = loaded.model.get_input_embeddings().weight
        mask = pick_mask_token(loaded.tokenizer, end_token_ids(loaded.model, loaded.tokenizer), embedding)
        mask_token_id, mask_text = mask.token_id, mask.reason
    elif not 0 <= mask_token_id < base.vocab_size:
        raise InvalidRequestError(
            f"--mask-token-id {mask_token_id} is outside the vocabulary [0, {base.vocab_size}) of "
            f"{initialized_from}; pass the id of a token the model practically never emits, or leave it out "
            "to pick one"
        )
    else:
        text = loaded.tokenizer.convert_ids_to_tokens(mask_token_id)
        mask_text = "an id no text encodes to" if text is None else repr(text)
    drafter = deer_from_causal_lm(
        loaded.model,
        args.num_layers,
        args.block_size,
        mask_token_id,
        tokenizer_fingerprint(loaded.tokenizer),
        initialized_from,
        args.denoising_steps,
    )
    with staged_directory(out) as tmp:
        save_draft_model(drafter, tmp, DTYPES[args.dtype])
    print(
        f"wrote {out}: DEER drafter from {args.num_layers}/{base.num_hidden_layers} layers of "
        f"{initialized_from}, {_parameter_count(drafter):,} parameters ({args.dtype}), "
        f"block size {args.block_size}, mask token {mask_token_id} ({mask_text})",
        flush=True,
    )


def _parameter_count(model: DEERDraftModel) -> int:
    """Each tensor once: a head tied to the embedding is not counted twice."""
    return sum(p.numel() for p in model.parameters())


def _run_info(args: argparse.Namespace) -> None:
    model = load_draft_model(args.drafter)
    if not isinstance(model, DEERDraftModel):
        raise CheckpointError(
            f"{args.drafter} is a {model.variant} drafter, not DEER; pass a directory written by "
            "diffdraft deer init (or a DEER drafter trained from one)"
        )
    settings = model.config.deer_config
    print(f"drafter: {args.drafter}")
    print(f"block size: {model.block_size}")
    print(f"denoising steps: {model.denoising_steps}")
    print(f"layers: {model.config.num_hidden_layers}")
    print(
        f"parameters: {_parameter_count(model):,} ({str(model.lm_head.weight.dtype).removeprefix('torch.')})"
    )
    print(f"mask token: {model.mask_token_id}")
    print(f"base architectures: {', '.join(settings.get('base_architectures') or ['?'])}")
    print(f"initialized from: {settings.get('initialized_from') or '?'}")
    print(f"tokenizer fingerprint: {model.tokenizer_fingerprint or 'not recorded'}")
