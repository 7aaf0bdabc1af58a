"""DART as a :class:`~diffdraft.drafters.base.Drafter`: one forward of one layer drafts every depth.

A prefix row needs the embedding of the token after it, which the target decides only at the end
of a round, so the taps the engine hands over wait until the next ``propose``, where the committed
tokens are known. Each prefix row's keys/values are then computed once and cached: with a single
layer they depend on that row's own input only. Per round the queries are the last prefix row
(it predicts depth 1) and the mask rows (depths 2..).
"""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.base import ForksByCopy, Proposal, vocab_columns
from diffdraft.drafters.compatibility import check_fits_target
from diffdraft.drafters.dart_model import DARTDraftModel
from diffdraft.kernels.packed_linear import has_packed_layers, pack_linear_layers
from diffdraft.target.model import TargetModel


class DARTDrafter(ForksByCopy):
    def __init__(self, model: DARTDraftModel, target: TargetModel) -> None:
        check_compatible(model, target)
        self.model = model.to(device=target.device, dtype=target.dtype).eval()
        if has_packed_layers(target.model):  # an inference-only target: its drafter packs alike
            pack_linear_layers(self.model)
        self.embed: nn.Module = target.model.get_input_embeddings()
        self.vocab_size = target.vocab_size
        self.target_layer_ids = list(model.target_layer_ids)
        self.max_depth = model.max_depth
        self._device = target.device
        self._draft_vocab = model.draft_vocab if model.d2t.shape[0] < target.vocab_size else None
        self._vocab_columns = vocab_columns(self._draft_vocab)
        self.reset()

    def reset(self) -> None:
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: list[torch.Tensor] = []  # taps not yet turned into prefix rows
        self._last_row: tuple[torch.Tensor, torch.Tensor] | None = None

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        self._pending.append(hidden)

    @torch.inference_mode()
    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        model = self.model
        root = token_ids.shape[0] - 1  # absolute position of the root; rows 0..root-1 are the prefix
        token_ids = token_ids.to(self._device)
        if self._pending:
            self._add_prefix_rows(token_ids)
        cached = self._kv[0].shape[2]
        masks = depth - 1
        inputs, residual = model.mask_inputs(1, masks)
        k, v = model.key_values(inputs, torch.arange(root, root + masks, device=self._device)[None])
        keys = torch.cat([self._kv[0], k], dim=2), torch.cat([self._kv[1], v], dim=2)
        # query 0 is the last prefix row (already among the keys), then the masks, causally
        query_positions = torch.arange(root - 1, root + masks, device=self._device)
        mask = (
            torch.arange(cached + masks, device=self._device)[None]
            <= torch.arange(cached - 1, cached + masks, device=self._device)[:, None]
        )
        hidden = model(
            torch.cat([self._last_row[0], inputs], dim=1),
            torch.cat([self._last_row[1], residual], dim=1),
            query_positions[None],
            keys,
            mask[None, None],
        )
        log_probs = model.logits(hidden[0]).float().log_softmax(-1)
        # tokens outside the draft vocabulary (if any) get probability 0
        return Proposal.restricted(log_probs, self._draft_vocab, self.vocab_size, self._vocab_columns)

    def _add_prefix_rows(self, token_ids: torch.Tensor) -> None:
        """Turn the waiting taps (positions ``root - n .. root - 1``) into cached prefix rows."""
        taps = torch.cat(self._pending)
        self._pending = []
        root = token_ids.shape[0] - 1
        first = root - taps.shape[0]
        next_embeds = self.embed(token_ids[first + 1 : root + 1])
        inputs, residual = self.model.prefix_inputs(taps[None], next_embeds[None].to(taps.dtype))
        positions = torch.arange(first, root, device=self._device)[None]
        k, v = self.model.key_values(inputs, positions)
        if self._kv is not None:
            k, v = torch.cat([self._kv[0], k], dim=2), torch.cat([self._kv[1], v], dim=2)
        self._kv = (k, v)
        self._last_row = (inputs[:, -1:], residual[:, -1:])


def check_compatible(model: DARTDraftModel, target: TargetModel) -> None:
    """Raise IncompatibleDrafterError when the drafter was made for another target."""
    config = model.config
    check_fits_target(
        "DART drafter",
        getattr(config, "target_hidden_size", None) or config.hidden_size,
        config.vocab_size,
        model.draft_vocab,
        getattr(config, "num_target_layers", None),
        model.target_layer_ids,
        target,
    )
