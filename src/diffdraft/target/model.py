"""The target model as the speculative loop sees it: prefill, verify a tree, keep the accepted path.

Wraps any Hugging Face causal LM whose attention accepts a custom 4D mask (Llama, Qwen2, Qwen3
and most decoder-only families through SDPA). Hidden-state taps follow DFlash semantics: layer
id ``i`` is the *output* of decoder layer ``i``, i.e. Hugging Face ``hidden_states[i + 1]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from diffdraft.errors import IncompatibleDrafterError, InvalidRequestError, UnsupportedModelError
from diffdraft.kernels.attention_window import LayerWindows, Mask
from diffdraft.kernels.graphed_verify import GraphedVerify
from diffdraft.kernels.kv_cache import growable_cache, keep_rows, shared_buffer
from diffdraft.kernels.lean_forward import LeanForward
from diffdraft.kernels.segment import Segment

PREFILL_CHUNK = 256
"""Prompt tokens per forward of a prefill through fused block ops: the causal mask of a chunk is
chunk x context, not prompt x prompt."""


@dataclass
class TargetOutput:
    logits: torch.Tensor
    """[n, V] logits after each input token (only the last row after a prefill)."""
    hidden: torch.Tensor | None
    """[n, T, H] outputs of the tapped decoder layers, or None when nothing is tapped."""


@dataclass
class VerifyInput:
    """One sequence's share of a verification forward: its tree's tokens over its own cache."""

    cache: DynamicCache
    token_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: Mask | None
    """The mask of :meth:`TargetModel.attention_mask`; None for a lone root (plain decoding)."""


class _TapsComplete(Exception):
    """Raised by the deepest tapped layer's hook to skip the layers and head after it."""


class TargetModel:
    """Forward passes over a KV cache, with tree masks and layer taps."""

    def __init__(self, model: PreTrainedModel, cuda_graphs: bool = False) -> None:
        """``cuda_graphs``: verify through :class:`GraphedVerify` (a CUDA target of a family the lean
        forward supports): the same forward, replayed without the host's kernel launches."""
        self.model = model.eval()
        self._first_parameter = next(model.parameters())
        """Its device is the model's (``Module.to`` moves parameters in place): read every round, and
        Hugging Face's ``model.device`` walks the modules each time."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        head = model.get_output_embeddings()
        self.vocab_size: int = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
        """(A head on GGUF blocks rebuilds its dense weight on every read of ``weight``.)"""
        self.max_context: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.windows = LayerWindows.of(config)
        """Which layers attend through a sliding window (:mod:`diffdraft.kernels.attention_window`)."""
        takes_cache = "cache" in inspect.signature(model.forward).parameters
        self._cache_keyword = "cache" if takes_cache else "past_key_values"
        """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns)."""
        self.lean = LeanForward(model) if LeanForward.supports(model) else None
        """The verification forward without Hugging Face's glue, for the families it supports."""
        self.graphed: GraphedVerify | None = None
        if cuda_graphs:
            if self.windows.window is not None:  # a graph has fixed shapes; a window's rows move
                raise UnsupportedModelError(
                    f"cuda_graphs does not take sliding-window attention; this {type(model).__name__} "
                    f"has a window of {self.windows.window} on layers {self.windows.windowed_layers}: "
                    "leave cuda_graphs off"
                )
            if self.lean is None or self.device.type != "cuda":
                raise UnsupportedModelError(
                    f"cuda_graphs needs a CUDA target of a family the lean forward runs "
                    f"(kernels/lean_forward.py); this one is a {type(model).__name__} on {self.device}: "
                    "leave cuda_graphs off"
                )
            self.graphed = GraphedVerify(self.lean)

    @property
    def device(self) -> torch.device:
        return self._first_parameter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        """Reject layer ids the target does not have, naming the valid range."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise IncompatibleDrafterError(
                f"target layer ids {bad} are out of range: the target has {self.num_layers} decoder layers, "
                f"so ids must be in [0, {self.num_layers - 1}] (DFlash convention: id i = output of layer i)"
            )

    def new_cache(self) -> DynamicCache:
        """An empty cache that appends and crops in place (:mod:`diffdraft.kernels.kv_cache`)."""
        return growable_cache(self.model.config)

    @torch.inference_mode()
    def prefill(self, cache: DynamicCache, token_ids: torch.Tensor, layer_ids: list[int]) -> TargetOutput:
        """Run the prompt through the model; logits are kept for the last position only.

        A target on fused block ops (:attr:`LeanForward.fused`) prefills through those ops,
        :data:`PREFILL_CHUNK` tokens a forward under a causal mask, so each prompt token gets what its
        own decode step would (and sooner than Hugging Face's forward on the dense copy:
        docs/decisions.md, "prefill through the fused layers"); others run Hugging Face's forward."""
        if token_ids.shape[0] == 0:
            raise InvalidRequestError("a prefill needs at least one prompt token; got an empty prompt")
        positions = torch.arange(token_ids.shape[0], device=self.device)
        if self.lean is None or self.lean.fused is None:
            return self._forward(cache, token_ids, positions, None, layer_ids, logits_to_keep=1)
        token_ids = token_ids.to(self.device)
        taps = []
        for start in range(0, token_ids.shape[0], PREFILL_CHUNK):
            chunk = token_ids[start : start + PREFILL_CHUNK]
            causal = torch.ones(chunk.shape[0], chunk.shape[0], dtype=torch.bool, device=self.device).tril()
            mask = self.attention_mask(cache, causal)
            logits, hidden = self.lean(
                cache, chunk, positions[start : start + chunk.shape[0]], mask, layer_ids, logits_to_keep=1
            )
            taps.append(hidden)
        return TargetOutput(logits=logits, hidden=torch.cat(taps) if layer_ids else None)

    @torch.inference_mode()
    def taps(self, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """Taps [n, T, H] of a whole sequence [n] (or [b, n, T, H] of right-padded sequences [b, n])
        without a cache, for training: the decoder stops after the deepest tapped layer (DFlare's taps
        end at 27 of SmolLM2's 30 layers). Attention is causal, so padding after a sequence's end
        leaves its rows as they are alone.

        Equal to :meth:`prefill`'s taps where the prefill runs Hugging Face's forward (a target on
        fused block ops prefills on its kernels instead: close, not equal); a tap of the last layer
        takes the full forward, because Hugging Face reports that layer after the final norm.
        """
        deepest = max(layer_ids)
        if deepest == self.num_layers - 1:
            return self._whole_sequences(token_ids, layer_ids, logits_to_keep=1).hidden
        decoder = self.model.get_decoder()
        outputs: dict[int, torch.Tensor] = {}

        def recorder(index: int):
            def record(module, args, output) -> None:
                outputs[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _TapsComplete

            return record

        hooks = [decoder.layers[i].register_forward_hook(recorder(i)) for i in set(layer_ids)]
        try:
            decoder(input_ids=_as_batch(token_ids).to(self.device), use_cache=False)
        except _TapsComplete:
            pass
        finally:
            for hook in hooks:
                hook.remove()
        taps = torch.stack([outputs[i] for i in layer_ids], dim=2)
        return taps if token_ids.dim() == 2 else taps[0]

    @torch.inference_mode()
    def taps_and_logits(self, token_ids: torch.Tensor, layer_ids: list[int]) -> TargetOutput:
        """Taps [n, T, H] and next-token logits [n, V] of a whole sequence [n] from one full forward
        (or [b, n, ...] of right-padded sequences [b, n], as :meth:`taps`).

        The logits are the target's own distribution at every position: distillation's soft labels
        come from the forward that yields the taps, at the cost of the few layers past the deepest tap.
        """
        return self._whole_sequences(token_ids, layer_ids, logits_to_keep=0)

    def _whole_sequences(
        self, token_ids: torch.Tensor, layer_ids: list[int], logits_to_keep: int
    ) -> TargetOutput:
        """One cacheless forward of a sequence [n] or right-padded sequences [b, n]; the outputs keep
        the input's leading dimensions."""
        out = self.model(
            input_ids=_as_batch(token_ids).to(self.device),
            use_cache=False,
            output_hidden_states=bool(layer_ids),
            logits_to_keep=logits_to_keep,
        )
        hidden = torch.stack([out.hidden_states[i + 1] for i in layer_ids], dim=2) if layer_ids else None
        if token_ids.dim() == 2:
            return TargetOutput(logits=out.logits, hidden=hidden)
        return TargetOutput(logits=out.logits[0], hidden=None if hidden is None else hidden[0])

    def attention_mask(self, cache: DynamicCache, tree_mask: torch.Tensor) -> Mask:
        """The additive mask for :meth:`verify`: every node sees the whole cached context, and the
        tree nodes ``tree_mask`` [n, n] allows (its ancestors and itself). A target with sliding
        windows gets them on top (:meth:`LayerWindows.mask`): a node's position is the cache length
        plus its depth, which is its count of ancestors."""
        past, nodes = cache.get_seq_length(), tree_mask.shape[0]
        tree_mask = tree_mask.to(self.device)
        mask = torch.zeros((nodes, past + nodes), dtype=self.dtype, device=self.device)
        mask[:, past:].masked_fill_(~tree_mask, torch.finfo(self.dtype).min)
        if self.windows.window is None:
            return mask[None, None]
        positions = past - 1 + tree_mask.sum(-1)
        keys = torch.cat([torch.arange(past, device=self.device), positions])
        return self.windows.mask(mask[None, None], positions, keys)

    @torch.inference_mode()
    def verify(
        self,
        cache: DynamicCache,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Mask | None,
        layer_ids: list[int],
    ) -> TargetOutput:
        """Score tree nodes in one forward, under a mask from :meth:`attention_mask` (None: one token).

        Targets of the families :class:`LeanForward` supports run it (same outputs, less host time per
        forward)."""
        forward = self.graphed or self.lean
        if forward is not None:
            logits, hidden = forward(
                cache, token_ids.to(self.device), position_ids.to(self.device), attention_mask, layer_ids
            )
            return TargetOutput(logits=logits, hidden=hidden)
        return self._forward(cache, token_ids, position_ids, attention_mask, layer_ids, logits_to_keep=0)

    @torch.inference_mode()
    def verify_batch(self, inputs: Sequence[VerifyInput], layer_ids: list[int]) -> list[TargetOutput]:
        """:meth:`verify` for several sequences, each over its own cache: targets :class:`LeanForward`
        supports verify them all in one packed forward (the weights are read once for every sequence's
        tree; each sequence's mask, a dict by layer type for a hybrid target, applies to its rows),
        others one forward per sequence."""
        if self.lean is None:
            return [self.verify(i.cache, i.token_ids, i.position_ids, i.mask, layer_ids) for i in inputs]
        segments = [Segment(i.cache, i.token_ids.shape[0], i.mask) for i in inputs]
        tokens = torch.cat([i.token_ids.to(self.device) for i in inputs])
        positions = torch.cat([i.position_ids.to(self.device) for i in inputs])
        return [
            TargetOutput(logits, hidden)
            for logits, hidden in self.lean.packed(segments, tokens, positions, layer_ids)
        ]

    def _forward(
        self,
        cache: DynamicCache,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Mask | None,
        layer_ids: list[int],
        logits_to_keep: int,
    ) -> TargetOutput:
        out = self.model(
            input_ids=token_ids[None].to(self.device),
            position_ids=position_ids[None].to(self.device),
            attention_mask=mask,
            use_cache=True,
            **{self._cache_keyword: cache},
            output_hidden_states=bool(layer_ids),
            logits_to_keep=logits_to_keep,
        )
        hidden = None
        if layer_ids:
            hidden = torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1)
        return TargetOutput(logits=out.logits[0], hidden=hidden)

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache: DynamicCache, start: int, path: list[int]) -> None:
        """Keep only the accepted nodes of the last verified tree in the cache.

        The tree occupied cache slots ``start + i`` for node ``i``; the accepted ``path`` (node
        indices, root first) is copied into ``start, start + 1, ...`` in place, then the cache is
        cropped. A path that is already a prefix (every chain) needs the crop only.
        """
        keep = len(path)
        if keep and path[-1] != keep - 1:  # rising indices from 0: a prefix when the last is keep - 1
            keep_rows(cache, start, path)
        excess = cache.get_seq_length() - (start + keep)
        if excess > 0:
            shared = shared_buffer(cache)
            if shared is not None:  # rows to drop: its buffer exists
                shared.crop(excess)
            else:
                cache.crop(-excess)


def _as_batch(token_ids: torch.Tensor) -> torch.Tensor:
    return token_ids if token_ids.dim() == 2 else token_ids[None]
