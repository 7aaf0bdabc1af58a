"""DEER as a :class:`~diffdraft.drafters.base.Drafter`: one forward of a small diffusion LM drafts a block.

The drafter keeps its own KV cache of the committed tokens (it taps nothing of the target), runs
as a :class:`~diffdraft.target.model.TargetModel` (same cache handling and CPU kernels as the target),
and per round feeds the tokens committed since the last round, causally, followed by the mask
rows; then it drops the mask rows from its cache again. Row layout: :mod:`.deer_model`.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.base import ForksByCopy, Proposal
from diffdraft.drafters.deer_model import DEERDraftModel
from diffdraft.errors import IncompatibleDrafterError
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.grouped_attention import use_grouped_attention
from diffdraft.kernels.packed_linear import has_packed_layers, pack_linear_layers
from diffdraft.target.model import TargetModel
from diffdraft.util.fingerprint import tokenizer_fingerprint


class DEERDrafter(ForksByCopy):
    def __init__(self, model: DEERDraftModel, target: TargetModel) -> None:
        check_compatible(model, target)
        self.model = model.to(device=target.device, dtype=target.dtype).eval()
        if has_packed_layers(target.model):  # an inference-only target: its drafter runs the same kernels
            pack_linear_layers(model.causal_lm)
            fuse_projections(model.causal_lm)
            use_grouped_attention(model.causal_lm)
        self.lm = TargetModel(model.causal_lm)
        self.target_layer_ids: list[int] = []
        self.max_depth = model.block_size
        self.mask_token_id = model.mask_token_id
        self.denoising_steps = model.denoising_steps
        self.reset()

    def reset(self) -> None:
        self._cache = self.lm.new_cache()

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        """Nothing to do: the committed tokens arrive with the next ``propose``."""

    @torch.inference_mode()
    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        """Depth 1 is the root row's (causal) prediction; the mask rows give depths 2..depth. With
        S denoising steps, each later forward shows the tokens filled so far in their rows, and a
        depth's distribution is the one its token was filled from (any proposal is exact: the
        target verifies every drafted token)."""
        cached = self._cache.get_seq_length()
        new = token_ids[cached:].to(self.lm.device)  # committed since the last round, root last
        rows = torch.full((depth - 1,), self.mask_token_id, device=new.device)
        log_probs = self._forward(torch.cat([new, rows]), cached, new.shape[0])
        self.lm.keep_path(self._cache, cached, list(range(new.shape[0])))  # drop the mask rows
        filled = torch.zeros(depth, dtype=torch.bool, device=new.device)
        per_step = -(-depth // self.denoising_steps)
        for _ in range(self.denoising_steps - 1):
            # fill the most confident open depths; depth d's token is the input of row d
            confidence = log_probs.max(-1).values.masked_fill(filled, float("-inf"))
            chosen = confidence.topk(min(per_step, int((~filled).sum()))).indices
            filled[chosen] = True
            rows = torch.where(filled[:-1], log_probs[:-1].argmax(-1), rows)
            if bool(filled[:-1].all()):  # every row shows a token: nothing left to refine
                break
            start = cached + new.shape[0]
            refined = self._forward(rows, start, 0)  # depths 2..; depth 1's row is causal: unchanged
            self.lm.keep_path(self._cache, start, [])
            log_probs[1:] = torch.where(filled[1:, None], log_probs[1:], refined)
        return Proposal(log_probs=log_probs)

    def _forward(self, rows: torch.Tensor, start: int, causal: int) -> torch.Tensor:
        """Log-probs of the rows from the last of the ``causal`` leading rows on (every row when
        none is causal); the other rows see the cache, the causal rows and one another. The rows
        enter the cache at ``start``: the caller crops what must not stay."""
        visible = torch.ones(rows.shape[0], rows.shape[0], dtype=torch.bool, device=rows.device)
        visible[:causal, :causal].tril_()
        visible[:causal, causal:] = False
        out = self.lm.verify(
            self._cache,
            rows,
            torch.arange(start, start + rows.shape[0], device=rows.device),
            self.lm.attention_mask(self._cache, visible),
            [],
        )
        return out.logits[max(causal - 1, 0) :].float().log_softmax(-1)


def check_compatible(model: DEERDraftModel, target: TargetModel) -> None:
    """A DEER drafter reads the target's tokens: only the vocabulary must match (and the tokenizer,
    checked by :func:`check_tokenizer` where the tokenizer is known)."""
    if model.block_size >= target.max_context:
        raise IncompatibleDrafterError(
            f"DEER block size {model.block_size} leaves no room for a prompt in the target's context of "
            f"{target.max_context} tokens: build a drafter with a smaller --block-size"
        )
    vocab = model.lm_head.weight.shape[0]
    if vocab != target.vocab_size:
        raise IncompatibleDrafterError(
            f"DEER drafter vocab size {vocab} != target vocab size {target.vocab_size}: the drafter was "
            "built for another tokenizer; build one from this target (diffdraft deer init --from TARGET)"
        )


def check_tokenizer(model: DEERDraftModel, tokenizer) -> None:
    """Refuse a drafter built with another tokenizer: same-size vocabularies can still disagree."""
    if model.tokenizer_fingerprint is None:
        return
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != model.tokenizer_fingerprint:
        raise IncompatibleDrafterError(
            f"the DEER drafter was built with tokenizer {model.tokenizer_fingerprint}, the target's is "
            f"{fingerprint} ({getattr(tokenizer, 'name_or_path', '') or '?'}): token ids mean different "
            "text; build a drafter from this target (diffdraft deer init --from TARGET) and train it"
        )
