"""What a training run is asked to do: :class:`TrainConfig`, checked when made, so a bad option fails
before any model loads (``diffdraft train fit`` makes its flags from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffdraft.drafters.dflash2_model import DFLASH2
from diffdraft.drafters.dflash_model import DFLASH
from diffdraft.drafters.dspark_model import DSPARK
from diffdraft.drafters.families import variants
from diffdraft.errors import InvalidRequestError

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LABELS = ["target", "tokens"]
INIT_LAYERS = ["random", "target"]
WHOLE_VOCABULARY = (DFLASH2, DSPARK)
"""Variants whose new drafters score the whole vocabulary (a DFlash2 config refuses a draft
vocabulary; DSpark's reduced one needs a head of its own, which diffdraft does not build)."""


@dataclass
class TrainConfig:
    output_dir: str
    variant: str = DFLASH
    num_layers: int = 2
    block_size: int = 16
    draft_length: int = 7
    """DART only: mask rows after the prefix, so one forward drafts draft_length + 1 positions."""
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    intermediate_size: int | None = None
    draft_vocab_size: int = 0
    """0 = score the whole target vocabulary (as the papers); K = only the K most frequent response tokens."""
    max_length: int = 1024
    anchors_per_sequence: int = 0
    """0 = one anchor per 6 sequence tokens, the paper's 512 anchors per 3072 tokens."""
    batch_size: int = 8
    epochs: int = 2
    max_steps: int = 0
    """0 = train ``epochs`` full epochs; N = exactly N optimizer steps (schedules span N steps)."""
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma_0: float | None = None
    """None = the drafter's paper value (its family's recipe, :mod:`diffdraft.train.objectives`; a
    drafter given to fine-tune decides its family)."""
    gamma_max: float | None = None
    """None = gamma_0 + epochs trained - 1 (DFlare's paper raises gamma by 1 per epoch), or gamma_0
    where the family's recipe fixes it (DART, DEER)."""
    micro_batch_size: int = 1
    """Sequences per forward: each process's share of a step runs in micro-batches of this many,
    padded to the longest (one target and one drafter forward each). The loss and the weights come
    out the same; on a GPU, where one sequence leaves most of it idle, 8-32 trains several times
    faster. Every drafter family (DFlare, DART, DEER) runs its micro-batch as one forward."""
    save_every: int = 200
    max_minutes: float = 0.0
    """Stop this process after about this many minutes of training (0: no limit), at a checkpoint:
    a lent GPU's lease ends at a fixed time, and a later run resumes from it where it stopped. The
    schedules still span the whole run, and final/ is written only when it is complete."""
    save_every_minutes: float = 0.0
    """Also checkpoint whenever this many minutes passed since the last checkpoint (0: by steps only),
    so a run whose speed is not known yet still leaves a recent one."""
    seed: int = 0
    compute_dtype: str = "float32"
    """"bfloat16" = mixed precision: the drafter's matmuls run in bfloat16 under autocast while its
    weights, gradients and optimizer state stay float32 (faster on GPUs and on CPUs with bf16 units)."""
    labels: str = "target"
    """"target" = distil the target: KL to its own next-token distribution at every position, from
    the forward that yields the taps; "tokens" = cross-entropy on the training text's tokens."""
    init_layers: str = "random"
    """"target" = draft layers start as copies of the target's last layers; "random" = fresh."""
    stage: int = 1
    """DEER only: 1 = continuation distillation (noised blocks, Eq. 1-2); 2 = Scribe refinement
    (the last R ~ U(1, max_suffix) tokens masked, weights alpha ** (R - i), Eq. 3-4)."""
    max_suffix: int = 96
    """DEER stage 2 only: the largest R (the paper's 96)."""
    tokenizer_fingerprint: str | None = None
    """DEER only: recorded in a new drafter, so a target with another tokenizer refuses it."""
    conv_kernel_size: int = 3
    """DFlash2 only: taps of each layer's block convolutions (the row itself and the rows before it)."""
    conv_group_size: int = 16
    """DFlash2 only: channels that share one row-computed kernel offset; must divide the hidden size."""
    selector_rank: int = 32
    """DFlash2 only: rank of the candidate selector's predecessor/successor codebooks."""
    selector_top_k: int = 16
    """DFlash2 only: head candidates the selector rescores per drafted position."""
    markov_rank: int = 64
    """DSpark only: rank of the Markov head (``markov_w1`` [V, r], ``markov_w2`` [r, V])."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("variant", variants()),
            ("compute_dtype", sorted(COMPUTE_DTYPES)),
            ("labels", LABELS),
            ("init_layers", INIT_LAYERS),
        ):
            if getattr(self, name) not in allowed:
                raise InvalidRequestError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.stage not in (1, 2):
            raise InvalidRequestError(
                f"stage must be 1 (continuation distillation) or 2 (Scribe refinement), got {self.stage}"
            )
        if self.micro_batch_size < 1:
            raise InvalidRequestError(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")
        if self.max_suffix < 1:
            raise InvalidRequestError(f"max_suffix must be at least 1, got {self.max_suffix}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "markov_rank"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise InvalidRequestError(f"--{flag} must be at least 1, got {getattr(self, name)}")
        if self.variant in WHOLE_VOCABULARY and self.draft_vocab_size:
            raise InvalidRequestError(
                f"--variant {self.variant} scores the whole vocabulary through the target's head; "
                "drop --draft-vocab-size (or train dflash, dflare or dart with it)"
            )

    def anchors_for(self, length: int) -> int:
        return self.anchors_per_sequence or max(1, length // 6)
