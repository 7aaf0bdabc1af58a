"""DEER as a :class:`~diffdraft.drafters.base.Drafter`: one forward of a small diffusion LM drafts a block.

The drafter keeps its own KV cache of the committed tokens (it taps nothing of the target), runs
as a :class:`~diffdraft.target.TargetModel` (same cache handling and CPU kernels as the target),
and per round feeds the tokens committed since the last round, causally, followed by the mask
rows; then it drops the mask rows from its cache again. Row layout: :mod:`.deer_model`.
"""

from __future__ import annotations

import torch

from diffdraft.drafters.base import Proposal
from diffdraft.drafters.deer_model import DEERDraftModel
from diffdraft.errors import IncompatibleDrafterError
from diffdraft.fused_projections import fuse_projections
from diffdraft.grouped_attention import use_grouped_attention
from diffdraft.ngram.trie import tokenizer_fingerprint
from diffdraft.packed_linear import has_packed_layers, pack_linear_layers
from diffdraft.target import TargetModel


class DEERDrafter:
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
        self.reset()

    def reset(self) -> None:
        self._cache = self.lm.new_cache()

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        """Nothing to do: the committed tokens arrive with the next ``propose``."""

    @torch.inference_mode()
    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        cached = self._cache.get_seq_length()
        new = token_ids[cached:].to(self.lm.device)  # committed since the last round, root last
        masks = depth - 1
        rows = torch.cat([new, torch.full((masks,), self.mask_token_id, device=new.device)])
        visible = torch.ones(rows.shape[0], rows.shape[0], dtype=torch.bool, device=new.device).tril_()
        visible[new.shape[0] :, new.shape[0] :] = True  # the mask rows see one another
        out = self.lm.verify(
            self._cache,
            rows,
            torch.arange(cached, cached + rows.shape[0], device=new.device),
            self.lm.attention_mask(self._cache, visible),
            [],
        )
        self.lm.keep_path(self._cache, cached, list(range(new.shape[0])))  # drop the mask rows
        return Proposal(log_probs=out.logits[new.shape[0] - 1 :].float().log_softmax(-1))


def check_compatible(model: DEERDraftModel, target: TargetModel) -> None:
    """A DEER drafter reads the target's tokens: only the vocabulary must match (and the tokenizer,
    checked by :func:`check_tokenizer` where the tokenizer is known)."""
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
