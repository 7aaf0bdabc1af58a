"""Target hidden states for training: computed online each step, or captured to disk once.

Online capture costs one target forward per sequence per epoch; the disk cache pays it once and
is reused across epochs (and across drafter variants that tap the same layers). The cache is
sharded safetensors plus an index, written shard by shard so a killed capture loses no finished
shard and resumes where it stopped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffdraft.target.model import TargetModel
from diffdraft.util.atomic_write import write_text_atomically
from diffdraft.util.progress import progress_bar

INDEX = "index.json"


class OnlineFeatures:
    """Taps [n, T, H] of ``layer_ids`` for a token sequence [n] (or [b, n, T, H] for right-padded
    sequences [b, n]), from a fresh target forward."""

    def __init__(self, target: TargetModel, layer_ids: list[int]) -> None:
        target.check_layer_ids(layer_ids)
        self.target = target
        self.layer_ids = layer_ids

    def __call__(self, sample_id: str, token_ids: torch.Tensor) -> torch.Tensor | None:
        """None for a drafter that taps nothing (DEER): then no target forward runs at all."""
        if not self.layer_ids:
            return None
        # a normal tensor: inference-mode tensors cannot enter autograd
        return self.target.taps(token_ids, self.layer_ids).clone()

    def with_logits(self, token_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Taps [n, T, H] (None when none are tapped) and the target's next-token logits [n, V],
        from one forward (a leading [b] for right-padded sequences [b, n])."""
        out = self.target.taps_and_logits(token_ids, self.layer_ids)
        return None if out.hidden is None else out.hidden.clone(), out.logits.clone()


class CachedFeatures:
    """Reads taps captured by :func:`capture_features`.

    The cache may hold more layers than the drafter taps (capture DFlare's nine once, train a
    DFlash drafter on five of them): the requested layers are picked out in order. A sample the
    cache lacks goes to ``fallback`` (online capture), or fails clearly without one: cache the
    samples seen every epoch, compute the ones seen once.
    """

    def __init__(
        self, cache_dir: str | os.PathLike, layer_ids: list[int], fallback: OnlineFeatures | None = None
    ) -> None:
        self.dir = Path(cache_dir)
        index = read_index(self.dir)
        cached = index["layer_ids"] or []
        missing = [layer for layer in layer_ids if layer not in cached]
        if missing:
            raise ValueError(
                f"feature cache {self.dir} holds layers {cached}, the drafter also taps {missing}: "
                "capture again (into another directory) with every layer the drafter taps"
            )
        self.columns = [cached.index(layer) for layer in layer_ids]
        self.shard_of: dict[str, str] = index["samples"]
        self.fallback = fallback
        self._loaded_name: str | None = None
        self._loaded: dict[str, torch.Tensor] = {}

    def __call__(self, sample_id: str, token_ids: torch.Tensor) -> torch.Tensor:
        name = self.shard_of.get(sample_id)
        if name is None and self.fallback is not None:
            return self.fallback(sample_id, token_ids)
        if name is None:
            raise KeyError(
                f"sample {sample_id!r} is not in the feature cache {self.dir}; run the capture again"
            )
        if name != self._loaded_name:
            self._loaded, self._loaded_name = load_file(self.dir / name), name
        hidden = self._loaded[sample_id]
        return hidden[: token_ids.shape[0], self.columns]


def read_index(cache_dir: Path) -> dict:
    path = cache_dir / INDEX
    if not path.is_file():
        return {"layer_ids": None, "samples": {}, "shards": 0}
    return json.loads(path.read_text())


def capture_features(
    target: TargetModel,
    layer_ids: list[int],
    samples: Iterable[tuple[str, torch.Tensor]],
    cache_dir: str | os.PathLike,
    shard_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    total: int | None = None,
) -> int:
    """Capture taps for every (id, token_ids) not cached yet; returns how many were captured now."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    index = read_index(cache_dir)
    if index["layer_ids"] not in (None, list(layer_ids)):
        raise ValueError(f"{cache_dir} already caches layers {index['layer_ids']}; use another directory")
    index["layer_ids"] = list(layer_ids)
    online = OnlineFeatures(target, layer_ids)
    pending: dict[str, torch.Tensor] = {}
    captured = 0

    def flush() -> None:
        name = f"shard-{index['shards']:05d}.safetensors"
        save_file(pending, cache_dir / (name + ".tmp"))
        os.replace(cache_dir / (name + ".tmp"), cache_dir / name)
        index["shards"] += 1
        index["samples"].update(dict.fromkeys(pending, name))
        write_text_atomically(cache_dir / INDEX, json.dumps(index))
        pending.clear()

    for sample_id, token_ids in progress_bar(
        samples, total=total, desc="capturing target features", unit="seq"
    ):
        if sample_id in index["samples"] or sample_id in pending:
            continue
        pending[sample_id] = online(sample_id, token_ids).to(dtype).contiguous().cpu()
        captured += 1
        if len(pending) >= shard_size:
            flush()
    if pending:
        flush()
    return captured
