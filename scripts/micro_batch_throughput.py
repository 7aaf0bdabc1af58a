"""Training tokens/s at several --micro-batch-size values, same samples and steps (issue 13).

    python scripts/micro_batch_throughput.py --target default --data replies.jsonl --micro 1 4 8
    python scripts/micro_batch_throughput.py --target tiny --micro 1 4 16 [--variant dart|deer]
    python scripts/micro_batch_throughput.py --target default-shape --device cuda --batch-size 64 \
        --micro 16 32 64 --out throughput.json

``--target default-shape`` needs no download: a random-weight Llama of the default target's shape
(SmolLM2-135M) trains the shipped drafter with its own recipe (target distillation, bf16, sequences
of 128-512 tokens); tokens/s does not depend on the weights' values, so a lent GPU measures the
trainer's speed without carrying the GGUF there.

``--target tiny`` is a random 6-layer Llama of hidden size 32 on random 60-120-token sequences:
per-call overhead dominates there, as it does for a small target on a GPU. The first step is
left out of the rate (warm-up). Losses are printed too: they must agree across sizes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.dart_model import DART
from diffdraft.drafters.deer_model import DEER
from diffdraft.drafters.dflash_model import DFLARE
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.train.config import TrainConfig
from diffdraft.train.dataset import TrainingSample, load_responses
from diffdraft.train.trainer import Trainer

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "src/diffdraft/default_drafter"


def tiny_setup(sequences: int, variant: str) -> tuple[torch.nn.Module, list[TrainingSample], dict]:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 120, (sequences,), generator=g).tolist()
    samples = [
        TrainingSample(f"s{i}", torch.randint(1, 63, (n,), generator=g), 20) for i, n in enumerate(lengths)
    ]
    drafter = {
        DFLARE: dict(
            variant=DFLARE, num_layers=1, block_size=4, target_layer_ids=[0, 2, 4], mask_token_id=62
        ),
        DART: dict(variant=DART, draft_length=3, target_layer_ids=[0, 2, 4]),
        DEER: dict(variant=DEER, num_layers=2, block_size=4, mask_token_id=62),
    }[variant]
    return model, samples, drafter


SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def default_shape_setup(sequences: int, device: str) -> tuple[torch.nn.Module, list[TrainingSample]]:
    """The default target's architecture with random weights, and random sequences of the recipe's
    lengths (--max-length 512; replies start about a quarter of the way in)."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 513, (sequences,), generator=g).tolist()
    samples = [
        TrainingSample(f"s{i}", torch.randint(0, SMOLLM2_135M["vocab_size"], (n,), generator=g), n // 4)
        for i, n in enumerate(lengths)
    ]
    return model, samples


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=["tiny", "default", "default-shape"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="also write the rates as JSON here")
    parser.add_argument("--data", help="responses jsonl (with --target default)")
    parser.add_argument(
        "--variant", choices=[DFLARE, DART, DEER], default=DFLARE, help="the drafter trained (--target tiny)"
    )
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.target == "default":
        model = load_target("default", dtype="bfloat16").model.to(args.device)
        samples = list(itertools.islice(load_responses(args.data, 512), 400))
        drafter_options, compute_dtype = {}, "bfloat16"
    elif args.target == "default-shape":
        model, samples = default_shape_setup(max(400, args.batch_size * args.steps), args.device)
        drafter_options, compute_dtype = {}, "bfloat16"
    else:
        model, samples, drafter_options = tiny_setup(64, args.variant)
        compute_dtype = "float32"
    rates = {}
    for micro in args.micro:
        with tempfile.TemporaryDirectory() as out:
            initial = load_draft_model(DEFAULT_DRAFTER) if args.target != "tiny" else None
            options = drafter_options or dict(variant=initial.variant, mask_token_id=initial.mask_token_id)
            config = TrainConfig(
                output_dir=out,
                batch_size=args.batch_size,
                max_steps=args.steps,
                micro_batch_size=micro,
                compute_dtype=compute_dtype,
                save_every=10**6,
                **options,
            )
            Trainer(config, TargetModel(model), samples, drafter=initial).train()
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        first, last = rows[0], rows[-1]
        rate = (last["tokens_seen"] - first["tokens_seen"]) / (
            last["elapsed_seconds"] - first["elapsed_seconds"]
        )
        rates[micro] = rate
        print(
            f"micro-batch {micro}: {rate:.0f} tokens/s; losses {[round(r['loss'], 4) for r in rows]}",
            flush=True,
        )
    if args.out:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        record = dict(vars(args), device_name=device, tokens_per_second_by_micro_batch=rates)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return rates


if __name__ == "__main__":
    main()
