"""The drafter training loop: DFlash / DFlare (DFlare paper, sections 3.3, 4.3, A.1), DART and DEER.

One optimizer step = ``batch_size`` sequences (global, over all processes). Each sequence gives
many anchored drafts trained in one drafter forward under a sparse mask (each family's objective:
``dflash_objective.py``, ``dart_objective.py``, ``deer_objective.py``). The target's embedding (and for
DFlash its LM head) is shared and frozen; only the drafter learns (DEER owns its embedding and head).

Everything random is derived from (seed, epoch, sample), so the run is reproducible, resumes
exactly after a kill at any instant (from its last complete checkpoint, which holds the optimizer,
scheduler and data position: :mod:`diffdraft.train.run_checkpoints`), and gives the same weights on
1 or N processes with the same global batch.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.families import DraftModel, check_compatible
from diffdraft.errors import InvalidRequestError, TrainingDivergedError
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch, pad_right
from diffdraft.train.blocks import sample_anchors
from diffdraft.train.config import COMPUTE_DTYPES, TrainConfig
from diffdraft.train.dataset import TrainingSample
from diffdraft.train.draft_vocab import frequent_tokens
from diffdraft.train.features import CachedFeatures, OnlineFeatures
from diffdraft.train.loss import gamma_at
from diffdraft.train.objectives import make_objective, recipe_for, recipe_for_variant
from diffdraft.train.run_checkpoints import (
    latest_checkpoint,
    load_training_state,
    remove_incomplete,
    save_checkpoint,
    save_final,
)
from diffdraft.util.atomic_write import write_text_atomically
from diffdraft.util.progress import progress_bar

METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_seconds: float = 0.0


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        target: TargetModel,
        samples: list[TrainingSample],
        feature_cache: str | os.PathLike | None = None,
        drafter: DraftModel | None = None,
    ) -> None:
        """``feature_cache``: a directory filled by :func:`capture_features` (samples missing from it
        are captured online each time); None = online capture for all."""
        self.config = config
        self.target = target
        self.samples = samples
        self.rank, self.world = _rank_and_world()
        if config.batch_size % self.world:
            raise InvalidRequestError(
                f"batch_size {config.batch_size} must be divisible by the number of processes ({self.world})"
            )
        self.output_dir = Path(config.output_dir)
        self.metrics_file = self.output_dir / METRICS_FILE
        self._check_output_dir()
        self.steps_per_epoch = len(samples) // config.batch_size
        if self.steps_per_epoch == 0:
            raise InvalidRequestError(
                f"{len(samples)} training samples are fewer than one batch ({config.batch_size}); "
                "lower batch_size or add data"
            )
        self.total_steps = config.max_steps or self.steps_per_epoch * config.epochs
        for p in target.model.parameters():
            p.requires_grad_(False)

        if self.rank == 0:  # the one writer: other ranks skip what is incomplete, as it does
            remove_incomplete(self.output_dir)
        resume_from = latest_checkpoint(self.output_dir)
        if resume_from is not None:
            drafter = load_draft_model(resume_from)
        elif drafter is None:
            drafter = self._new_drafter()
        check_compatible(drafter, target)
        self.drafter = drafter.to(device=target.device, dtype=torch.float32).train()
        layer_ids = self.drafter.target_layer_ids
        self.online = OnlineFeatures(target, layer_ids)
        if feature_cache and config.labels == "target":
            raise InvalidRequestError(
                "labels 'target' distils the target's distributions, which come from the same online "
                "forward as the features: drop the feature cache, or train on labels 'tokens'"
            )
        self.features = (
            CachedFeatures(feature_cache, layer_ids, fallback=self.online) if feature_cache else self.online
        )
        self.positions = self.drafter.max_depth + 1  # per-depth statistics; index 0 unused
        objective = make_objective(self.drafter, target.model, config.stage, config.max_suffix)
        self.model = DistributedDataParallel(objective) if self.world > 1 else objective
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.state = TrainState()
        if resume_from is not None:
            saved = load_training_state(resume_from)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self.state = TrainState(**saved["state"])
        if self.rank == 0:
            self._forget_metrics_after(self.state.step)  # a fresh start (step 0): an aborted run's rows

    def _forget_metrics_after(self, step: int) -> None:
        """Drop the log rows of the steps after the checkpoint resumed from, or on a fresh start all
        rows of an earlier run stopped before its first checkpoint (and a row half-written at the
        kill): the run trains those steps again, and keeping both gave two rows per step."""
        path = self.metrics_file
        if not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                if line.endswith("\n") and json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        write_text_atomically(path, "".join(kept))

    def _check_output_dir(self) -> None:
        """Fail before any compute if checkpoints could not be written. The probe is named per process:
        under DDP every rank probes the same directory at once."""
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            probe = self.output_dir / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise InvalidRequestError(
                f"cannot write to the output directory {self.output_dir} ({err}); "
                "choose a writable --output-dir"
            ) from err

    def _new_drafter(self) -> DraftModel:
        c = self.config
        vocab = (
            frequent_tokens(self.samples, self.target.vocab_size, c.draft_vocab_size)
            if c.draft_vocab_size
            else None
        )
        torch.manual_seed(c.seed)
        recipe = recipe_for_variant(c.variant)
        if recipe.needs_mask_token and c.mask_token_id is None:
            raise InvalidRequestError("mask_token_id is required to build a new drafter")
        return recipe.new_model(c, self.target, vocab)

    def _lr_factor(self, step: int) -> float:
        """Linear warmup then cosine decay to zero."""
        warmup = max(1, round(self.config.warmup_ratio * self.total_steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def _batch(self, step: int) -> list[int]:
        """Sample indices of this process's share of global step ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(
            len(self.samples), generator=torch.Generator().manual_seed(self.config.seed + epoch)
        )
        start = within * self.config.batch_size
        batch = order[start : start + self.config.batch_size].tolist()
        share = len(batch) // self.world
        return batch[self.rank * share : (self.rank + 1) * share]

    def micro_batches(self, batch: list[int]) -> list[list[TrainingSample]]:
        """This process's share of a step as micro-batches of ``micro_batch_size`` sequences, by length
        (similar lengths pad little)."""
        samples = sorted((self.samples[i] for i in batch), key=lambda s: s.token_ids.shape[0])
        size = self.config.micro_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    def batch_loss(self, samples: list[TrainingSample], step: int, gamma: float):
        """Mean loss over the sequences, and per-position hits, agreements and counts summed over every
        anchored block of theirs."""
        c = self.config
        epoch = step // self.steps_per_epoch
        anchors = []
        for sample in samples:
            seed = zlib.crc32(f"{c.seed}:{epoch}:{sample.sample_id}".encode())
            length = sample.token_ids.shape[0]
            anchors.append(
                sample_anchors(
                    sample.response_start, length, c.anchors_for(length), torch.Generator().manual_seed(seed)
                )
            )
        token_ids = pad_right([s.token_ids for s in samples])
        batch = TrainingBatch(
            token_ids, [s.token_ids.shape[0] for s in samples], anchors, [s.response_start for s in samples]
        )
        if c.labels == "target":
            batch.taps, batch.target_logits = self.online.with_logits(token_ids)
        elif self.drafter.target_layer_ids:  # cached (bfloat16, on the host) or captured online
            device, dtype = self.target.device, self.target.dtype
            batch.taps = pad_right(
                [self.features(s.sample_id, s.token_ids).to(device, dtype) for s in samples]
            )
        compute_dtype = COMPUTE_DTYPES[c.compute_dtype]
        with torch.autocast(
            self.target.device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32
        ):
            return self.model(batch, gamma)

    def train(self, on_step=None) -> TrainState:
        """Run to the end (or resume to it); ``on_step(step)`` is a test hook called after each step."""
        c = self.config
        epochs = self.total_steps / self.steps_per_epoch
        recipe = recipe_for(self.drafter)  # a drafter given to fine-tune decides, not the config
        gamma_0 = c.gamma_0 if c.gamma_0 is not None else recipe.gamma_0
        gamma_max = c.gamma_max
        if gamma_max is None:
            gamma_max = gamma_0 if recipe.fixed_gamma else gamma_0 + max(0.0, epochs - 1)
        progress = progress_bar(
            total=self.total_steps, initial=self.state.step, desc="training drafter", disable=self.rank != 0
        )
        started = last_save = time.perf_counter()
        while self.state.step < self.total_steps:
            begin = time.perf_counter()
            step = self.state.step
            gamma = gamma_at(step, self.total_steps, gamma_0, gamma_max)
            batch = self._batch(step)
            # summed on the device and read once per step (a read per sequence stalled the GPU each
            # time): loss, hits, agreements, counts, then rank 0's out-of-time flag and the grad norm
            sums = torch.zeros(2 + 3 * self.positions, device=self.target.device)
            self.optimizer.zero_grad(set_to_none=True)
            micro_batches = self.micro_batches(batch)
            for i, samples in enumerate(micro_batches):
                sync = i == len(micro_batches) - 1 or self.world == 1
                context = self.model.no_sync() if not sync else nullcontext()
                share = len(samples) / len(batch)  # the step's loss is the mean over its sequences
                with context:
                    loss, h, a, n = self.batch_loss(samples, step, gamma)
                    (loss * share).backward()
                sums[:-1] += torch.cat([(loss * share).detach().float()[None], h, a, n])
                self.state.tokens_seen += sum(int(s.token_ids.shape[0]) for s in samples) * self.world
            # rank 0's clock decides for every rank whether the time is up (summed with the statistics);
            # a fill, not a tensor built from a host value: that copy would wait for the GPU too
            if self.rank == 0 and _minutes_since(started) >= c.max_minutes > 0:
                sums[-1] = 1.0
            if self.world > 1:  # log the global batch, not rank 0's share
                dist.all_reduce(sums)
                sums[0] /= self.world
            # Clipped before the read so its norm comes back with the statistics. Clipping touches
            # only the gradients: on a non-finite loss the error below still leaves the weights as
            # they were. (Every rank holds the same reduced gradients, hence the same norm.)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), c.grad_clip)
            sums = torch.cat([sums, grad_norm.reshape(1).to(sums)]).cpu()
            out_of_time = bool(sums[-2] > 0)
            total_loss = float(sums[0])
            hits, agreements, counts = sums[1:-2].split(self.positions)
            if not math.isfinite(total_loss):  # before the step: the weights and checkpoints stay sound
                raise TrainingDivergedError(
                    f"training diverged at step {step + 1} (loss {total_loss}); rerun to resume from the "
                    "last checkpoint with a lower --learning-rate (DEER stage 2: a lower alpha, --gamma-0; "
                    "the paper saw 1.05 diverge and 1.01 train)"
                )
            self.optimizer.step()
            self.scheduler.step()
            self.state.step += 1
            self.state.elapsed_seconds += time.perf_counter() - begin
            accuracy = (hits / counts.clamp_min(1))[1:].tolist()
            if self.rank == 0:
                record = {
                    "step": self.state.step,
                    "loss": total_loss,
                    "gamma": gamma,
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": float(sums[-1]),
                    "accuracy_by_position": accuracy,
                    **(
                        {"agreement_by_position": (agreements / counts.clamp_min(1))[1:].tolist()}
                        if c.labels == "target"
                        else {}
                    ),
                    "tokens_seen": self.state.tokens_seen,
                    "elapsed_seconds": self.state.elapsed_seconds,
                }
                with self.metrics_file.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                progress.set_postfix(loss=f"{total_loss:.3f}", acc1=f"{accuracy[0]:.2f}")
                progress.update(1)
                due = _minutes_since(last_save) >= c.save_every_minutes > 0
                if (
                    due
                    or out_of_time
                    or self.state.step % c.save_every == 0
                    or self.state.step == self.total_steps
                ):
                    self.save_checkpoint()
                    last_save = time.perf_counter()
            if on_step is not None:
                on_step(self.state.step)
            if out_of_time and self.state.step < self.total_steps:
                progress.close()
                if self.rank == 0:
                    print(
                        f"diffdraft train: stopped after {c.max_minutes:g} minutes at step {self.state.step} "
                        f"of {self.total_steps} (checkpoint-{self.state.step}); run again to resume",
                        file=sys.stderr,
                    )
                return self._finish_processes()
        progress.close()
        if self.rank == 0:
            save_final(self.output_dir, self.drafter)
        return self._finish_processes()

    def _finish_processes(self) -> TrainState:
        if self.world > 1:  # every rank returns once rank 0 has written; a rank that ran ahead into
            dist.barrier()  # process-group teardown aborted the run at exit (gloo)
            # Free DDP's reducer now, while the group lives: left to the garbage collector it could
            # outlive destroy_process_group and abort the process at exit (gloo, rarely).
            self.model = self.model.module
        return self.state

    def save_checkpoint(self) -> Path:
        """Drafter in the official layout plus what an exact resume needs, written whole
        (:func:`~diffdraft.train.run_checkpoints.save_checkpoint`)."""
        path = self.output_dir / f"checkpoint-{self.state.step}"
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "state": asdict(self.state),
            "config": asdict(self.config),
        }
        save_checkpoint(path, self.drafter, state)
        return path


def _minutes_since(moment: float) -> float:
    return (time.perf_counter() - moment) / 60
