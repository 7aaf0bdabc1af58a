"""DFlash / DFlare as a :class:`~diffdraft.drafters.base.Drafter`: one forward drafts a whole block.

Holds the draft network plus the target's (frozen) embedding and LM head, and caches every
draft layer's context keys/values, so each round only projects the newly committed tokens. Beside a
bfloat16 target on diffdraft's CPU kernels it drafts through the fused decoder ops
(:mod:`~diffdraft.drafters.fused_dflash`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from diffdraft.drafters.base import ForksByCopy, Proposal, vocab_columns
from diffdraft.drafters.compatibility import check_fits_target
from diffdraft.drafters.conditional_proposal import ConditionalProposal
from diffdraft.drafters.dflash_model import DFLASH, DFlashDraftModel, draft_head
from diffdraft.drafters.draft_context import DraftContext
from diffdraft.drafters.fused_dflash import DraftBlock, FusedDraftLayers
from diffdraft.errors import IncompatibleDrafterError
from diffdraft.kernels.fused_projections import fuse_projections
from diffdraft.kernels.huge_pages import block_weights_on_huge_pages
from diffdraft.kernels.packed_linear import has_packed_layers, pack_linear, pack_linear_layers
from diffdraft.kernels.quantized.block_linear import (
    BlockQuantizedLinear,
    int8_operands,
    kernel_rows_only,
    q4_1_linear,
    runs_int8_kernel,
)
from diffdraft.kernels.rotary_table import RotaryTable
from diffdraft.target.model import TargetModel


class DFlashDrafter(ForksByCopy):
    def __init__(self, model: DFlashDraftModel, target: TargetModel) -> None:
        check_compatible(model, target)
        self.model = model.to(device=target.device, dtype=target.dtype).eval()
        self.embed: nn.Module = target.model.get_input_embeddings()
        laid_out = has_packed_layers(target.model)
        lm_head = target.model.get_output_embeddings()
        self.head = (
            model.lm_head
            if model.lm_head is not None
            else _drafting_head(lm_head, model.draft_vocab, laid_out)
        )
        if laid_out and model.runs_fused:  # an inference-only target: its drafter is laid out alike
            int8 = runs_int8_kernel(target.model)
            lay_out = q4_1_linear if int8 else pack_linear
            if int8 and model.draft_vocab is not None:  # its own rows of the target's head: the most
                self.head = q4_1_linear(self.head)  # bytes a round streams (the whole head stays shared)
            pack_linear_layers(self.model.layers, lay_out)  # not DFlare's fusion: a weight, never called
            fuse_projections(self.model.layers)
            if self.model.variant == DFLASH:
                self.model.fc = lay_out(self.model.fc)
            block_weights_on_huge_pages(self.model, self.head)  # as its target's (docs/decisions.md)
        self._fused = FusedDraftLayers.build(self.model) if model.runs_fused else None
        self._lm_head = _one_op_head(self._fused, self.embed, self.head)
        """The LM head's int8 operands where a drafting round runs as one op
        (:meth:`FusedDraftLayers.draft_block`); None where it runs step by step."""
        self._rope = RotaryTable(self.model.rotary_emb)  # for the fused forward (the module has its own)
        self.vocab_size = target.vocab_size
        self._vocab_columns = vocab_columns(self.model.draft_vocab)
        self.target_layer_ids = list(model.target_layer_ids)
        self.max_depth = model.max_depth
        self._device = target.device
        self.reset()

    def reset(self) -> None:
        self._context = DraftContext(len(self.model.layers))
        self._pending: list[tuple[torch.Tensor, int]] = []
        """Committed tokens' target states not yet projected into the context, with their positions."""

    def extend_context(self, hidden: torch.Tensor | None, start: int) -> None:
        """Keep the committed tokens' states; they are projected when this sequence next drafts, all
        at once, so a round that does not draft (budget 0) costs the drafter nothing. Tokens whose
        states were not tapped (None) leave a gap (:meth:`tolerates_gaps`)."""
        if hidden is not None:
            self._pending.append((hidden, start))  # reset rebinds the list: a fork never shares it

    def tolerates_gaps(self) -> bool:
        """Yes: every context row is projected at its own position, and a block attends to whatever
        rows there are. A gap costs acceptance for the next few drafting rounds only, then none
        (docs/decisions.md, "shared plain rounds go untapped")."""
        return True

    def _pending_taps(self) -> torch.Tensor | None:
        """The pending states in one tensor (one round's commit: no copy); None when none wait."""
        states = [hidden for hidden, _ in self._pending]
        return None if not states else states[0] if len(states) == 1 else torch.cat(states)

    @torch.inference_mode()
    @kernel_rows_only()
    def _projected_context(self) -> DraftContext:
        """The context keys/values of every draft layer, the pending states projected first. Block
        layers stay on their kernel however many states are pending (a prompt's, or those of many
        rounds without drafting): a dense copy computes other numbers than later rounds' kernel, and
        on a CPU without bfloat16 matmuls (AVX2) is far slower for a prompt (docs/decisions.md, "a
        drafter's context projected on the kernel")."""
        hidden = self._pending_taps()
        if hidden is not None:
            spans = [range(start, start + rows.shape[0]) for rows, start in self._pending]
            positions = torch.tensor([p for span in spans for p in span], device=self._device)[None]
            if self._fused is None:
                self._context.append(self.model.context_kv(hidden[None], positions))
            else:
                cos, sin = self._rope(hidden, positions)
                self._fused.project(hidden, cos[0], sin[0], self._context)
            self._pending = []
        return self._context

    @torch.inference_mode()
    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        start = token_ids.shape[0] - 1
        first = self._taps_run_start(start)
        if self._lm_head is not None and self._context.length and first is not None:
            return self._proposal(self._drafted_in_one_op(int(token_ids[-1]), first, start, depth))
        rows = self.model.block_rows(depth)
        block = torch.full((rows,), self.model.mask_token_id, device=self._device)
        block[0] = token_ids[-1]  # the root, copied on the device (int() would wait for a GPU)
        positions = torch.arange(start, start + rows, device=self._device)[None]
        context = self._projected_context()
        embeds = self.embed(block)
        if self._fused is None:
            hidden = self.model(embeds[None], positions, context.layers())[0]
        else:
            cos, sin = self._rope(embeds, positions)
            hidden = self._fused(embeds, cos[0], sin[0], [context], [slice(None)])
        return self._drafted(hidden[rows - depth :][None], block[:1], [depth])[0]

    def _taps_run_start(self, start: int) -> int | None:
        """The position of the first pending tap when the pending taps are those of consecutive
        positions up to ``start`` (exclusive), as rounds commit them (``start`` when none wait): then
        one rotary span covers them and the block rooted at ``start``. None otherwise."""
        first = self._pending[0][1] if self._pending else start
        position = first
        for hidden, begin in self._pending:
            if begin != position:
                return None
            position += hidden.shape[0]
        return first if position == start else None

    def _drafted_in_one_op(self, root: int, first: int, start: int, depth: int) -> torch.Tensor:
        """:meth:`propose`'s log-probabilities [depth, draft vocabulary], the pending taps (positions
        ``first`` .. ``start - 1``) projected first, all in one op (the same bits as step by step)."""
        taps = self._pending_taps()
        self._pending = []
        weight = self.embed.weight
        cos, sin = self._rope.rows(weight, first, start + depth + 1)
        block = DraftBlock(root, depth, taps, self.model.mask_token_id, weight, self._lm_head)
        return self._fused.draft_block(block, self._context, cos, sin)

    @torch.inference_mode()
    def propose_batch(
        self, forks: Sequence[DFlashDrafter], token_ids: Sequence[torch.Tensor], depths: Sequence[int]
    ) -> list[Proposal]:
        """:meth:`propose` for every fork (of this drafter: the same weights) in one forward.

        Through the fused ops the blocks' rows are stacked and each block attends over its own
        context: every proposal is what its fork drafts alone. Otherwise blocks are padded to the
        deepest and contexts to the longest; a mask lets each block row see its own context and its
        own block only, so each proposal is its fork's own (equal up to the attention kernel's
        rounding: a masked attention sums in another order than an unmasked one).
        """
        if self._fused is not None:
            return self._propose_stacked(forks, token_ids, depths)
        width = max(self.model.block_rows(depth) for depth in depths)
        contexts = [fork._projected_context().layers() for fork in forks]
        lengths = [context[0][0].shape[2] for context in contexts]
        longest = max(lengths)
        blocks = torch.full((len(forks), width), self.model.mask_token_id, device=self._device)
        positions = torch.empty((len(forks), width), dtype=torch.long, device=self._device)
        visible = torch.zeros((len(forks), 1, width, longest + width), dtype=torch.bool, device=self._device)
        for row, (ids, depth, length) in enumerate(zip(token_ids, depths, lengths, strict=True)):
            blocks[row, 0] = ids[-1]
            positions[row] = torch.arange(ids.shape[0] - 1, ids.shape[0] - 1 + width, device=self._device)
            visible[row, :, :, :length] = True
            visible[row, :, :, longest : longest + self.model.block_rows(depth)] = True
        dtype = self.model.norm.weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self._device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        context_kv = [
            tuple(_padded([context[layer][part] for context in contexts], longest) for part in (0, 1))
            for layer in range(len(self.model.layers))
        ]
        hidden = self.model(self.embed(blocks), positions, context_kv, mask)
        return self._drafted(hidden[:, self.model.anchor_rows :], blocks[:, 0], depths)

    def _propose_stacked(
        self, forks: Sequence[DFlashDrafter], token_ids: Sequence[torch.Tensor], depths: Sequence[int]
    ) -> list[Proposal]:
        """:meth:`propose_batch` through the fused ops: the blocks' rows one after another."""
        mask_id = self.model.mask_token_id
        pairs = list(zip(token_ids, depths, strict=True))
        blocks = torch.tensor([token for ids, depth in pairs for token in [int(ids[-1])] + [mask_id] * depth])
        positions = torch.cat([torch.arange(ids.shape[0] - 1, ids.shape[0] + depth) for ids, depth in pairs])
        edges = list(itertools.accumulate((depth + 1 for depth in depths), initial=0))
        rows = [slice(a, b) for a, b in itertools.pairwise(edges)]
        embeds = self.embed(blocks.to(self._device))
        cos, sin = self._rope(embeds, positions.to(self._device)[None])
        contexts = [fork._projected_context() for fork in forks]
        hidden = self._fused(embeds, cos[0], sin[0], contexts, rows)
        drafted = torch.cat([hidden[part][1:] for part in rows])  # every row but each block's anchor
        log_probs = self.head(drafted).float().log_softmax(-1)
        return [self._proposal(part) for part in log_probs.split(list(depths))]

    def _drafted(self, hidden: torch.Tensor, roots: torch.Tensor, depths: Sequence[int]) -> list[Proposal]:
        """One proposal per block from its drafting rows' hidden states [b, rows, H] (a block's first
        ``depths[i]`` rows are its own), each block's anchor in ``roots`` [b]: the rows' distributions,
        or where a position's distribution depends on the token before it, those after any predecessor
        (:class:`ConditionalProposal`)."""
        conditionals = self.model.draft_conditionals(hidden, self.head)
        if conditionals is None:
            log_probs = self.model.draft_log_probs(hidden, self.head, roots)
            return [self._proposal(log_probs[row, :depth]) for row, depth in enumerate(depths)]
        columns = self._vocab_columns
        return [
            ConditionalProposal(rows, roots[row], self.vocab_size, columns, depth)
            for row, (rows, depth) in enumerate(zip(conditionals, depths, strict=True))
        ]

    def _proposal(self, log_probs: torch.Tensor) -> Proposal:
        """The proposal of drafted rows ``log_probs`` [depth, draft vocabulary]: tokens outside the
        draft vocabulary get probability 0."""
        return Proposal.restricted(log_probs, self.model.draft_vocab, self.vocab_size, self._vocab_columns)


def _drafting_head(lm_head: nn.Module, draft_vocab: torch.Tensor | None, laid_out: bool) -> nn.Module:
    """The target's LM head over the draft vocabulary. A block-quantized head keeps its own blocks
    (its rows, never dequantized here: beside an int8 target the drafter rounds a draft vocabulary's
    rows to Q4_1 after); any other is cut to the rows, and packed beside an inference-only target."""
    if isinstance(lm_head, BlockQuantizedLinear):
        return lm_head if draft_vocab is None else lm_head.rows(draft_vocab)
    head = draft_head(lm_head, draft_vocab)
    return pack_linear(head) if laid_out else head


def _one_op_head(fused: FusedDraftLayers | None, embed: nn.Module, head: nn.Module) -> tuple | None:
    """The LM head's int8 kernel operands when a drafting round can run as one op: fused layers that
    draft in one op, a plain embedding table (a scaled one embeds otherwise) and a head on the kernel."""
    if fused is None or not fused.drafts_in_one_op() or type(embed) is not nn.Embedding:
        return None
    return int8_operands(head)


def _padded(rows: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Context keys or values [1, heads, n_i, d] of several sequences as one [b, heads, length, d],
    zero past each one's n_i (masked out)."""
    first = rows[0]
    out = first.new_zeros((len(rows), first.shape[1], length, first.shape[3]))
    for row, part in enumerate(rows):
        out[row, :, : part.shape[2]] = part[0]
    return out


def check_compatible(model: DFlashDraftModel, target: TargetModel) -> None:
    """Raise IncompatibleDrafterError when the drafter was made for another target."""
    config = model.config
    check_fits_target(
        "drafter",
        config.hidden_size,
        config.vocab_size,
        model.draft_vocab,
        getattr(config, "num_target_layers", None),
        model.target_layer_ids,
        target,
    )
    if not 0 <= model.mask_token_id < target.vocab_size:
        raise IncompatibleDrafterError(
            f"drafter mask_token_id {model.mask_token_id} is outside the target vocabulary "
            f"(size {target.vocab_size}): the drafter belongs to another target"
        )
