"""Random drafters for a tiny target, and forks of one with committed contexts."""

from __future__ import annotations

import torch

from diffdraft.drafters.dart_model import DARTDraftModel, make_dart_config
from diffdraft.drafters.dflash2_model import DFlash2DraftModel, make_dflash2_config
from diffdraft.drafters.dflash_model import DFLASH, DFlashDraftModel, make_draft_config
from diffdraft.drafters.dspark_model import DSparkDraftModel, make_dspark_config

DFLASH_LAYER_WEIGHTS = frozenset(
    {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
)
"""A DFlash layer's weights, named as the official checkpoints (and vLLM's ``qwen3_dflash``) name
them: a Qwen3 decoder layer's."""


def tiny_drafter(
    target: torch.nn.Module,
    seed: int = 0,
    layers: int = 1,
    block_size: int = 4,
    variant: str = DFLASH,
    target_layer_ids: list[int] | None = None,
    draft_vocab: list[int] | None = None,
) -> DFlashDraftModel:
    """A random drafter; ``draft_vocab`` restricts it to scoring only those target tokens."""
    config = make_draft_config(
        target.config,
        num_layers=layers,
        block_size=block_size,
        mask_token_id=target.config.vocab_size - 2,
        target_layer_ids=target_layer_ids or [0, target.config.num_hidden_layers - 1],
        variant=variant,
        draft_vocab_size=len(draft_vocab or []),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).to(target.dtype)
    if draft_vocab:
        model.draft_vocab.copy_(torch.tensor(sorted(draft_vocab)))
    return model


def tiny_dflash2(
    target: torch.nn.Module,
    seed: int = 0,
    layers: int = 2,
    block_size: int = 5,
    selector_top_k: int = 6,
    target_layer_ids: list[int] | None = None,
) -> DFlash2DraftModel:
    """A random DFlash2 drafter (vLLM's layout) whose convs and selector weigh in: their kernels and
    codebooks are drawn as large as the rest, not left near the identity and zero."""
    config = make_dflash2_config(
        target.config,
        num_layers=layers,
        block_size=block_size,
        mask_token_id=target.config.vocab_size - 2,
        target_layer_ids=target_layer_ids or [0, target.config.num_hidden_layers - 1],
        conv_group_size=target.config.hidden_size // 4,
        selector_top_k=selector_top_k,
    )
    torch.manual_seed(seed)
    model = DFlash2DraftModel(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "conv" in name or "codebook" in name:
                weight.normal_(std=0.5)
    return model.to(target.dtype)


def tiny_dspark(
    target: torch.nn.Module,
    seed: int = 0,
    layers: int = 2,
    block_size: int = 4,
    draft_vocab: list[int] | None = None,
    sample_from_anchor: bool = True,
    target_layer_ids: list[int] | None = None,
    confidence_head: bool = True,
) -> DSparkDraftModel:
    """A random Qwen3 DSpark drafter (vLLM's layout, with a confidence head); ``draft_vocab`` gives it
    its own head over those target tokens and the ``d2t`` offsets that name them;
    ``sample_from_anchor`` False gives it DFlash's block (the anchor row drafts nothing)."""
    config = make_dspark_config(
        target.config,
        num_layers=layers,
        block_size=block_size,
        noise_token_id=target.config.vocab_size - 2,
        target_layer_ids=target_layer_ids or [0, target.config.num_hidden_layers - 1],
        draft_vocab_size=len(draft_vocab or []) or None,
        confidence_head=confidence_head,
    )
    config.sample_from_anchor = sample_from_anchor
    torch.manual_seed(seed)
    model = DSparkDraftModel(config)
    if draft_vocab:
        ids = torch.tensor(sorted(draft_vocab))
        model.d2t.copy_(ids - torch.arange(len(ids)))
    return model.to(target.dtype)


def tiny_dart(
    target: torch.nn.Module,
    seed: int = 0,
    draft_length: int = 3,
    draft_vocab: list[int] | None = None,
    init_std: float = 0.2,
) -> DARTDraftModel:
    """A random DART drafter tapping three target layers; ``draft_vocab`` restricts its head."""
    layers = target.config.num_hidden_layers
    config = make_dart_config(
        target.config,
        draft_length=draft_length,
        target_layer_ids=[0, layers // 2, layers - 1],
        draft_vocab_size=len(draft_vocab or []),
    )
    config.initializer_range = init_std  # peaked draft distributions, like a trained drafter's
    torch.manual_seed(seed)
    model = DARTDraftModel(config).to(target.dtype)
    if draft_vocab:
        model.set_draft_vocab(torch.tensor(draft_vocab))
    return model


def forks_with_contexts(drafter, lengths: list[int], seed: int, hidden_size: int) -> tuple[list, list]:
    """Forks of ``drafter`` (tapping 2 float64 layers) with contexts of the given lengths, and each
    one's committed tokens."""
    g = torch.Generator().manual_seed(seed)
    forks, token_ids = [], []
    for length in lengths:
        fork = drafter.fork()
        hidden = torch.randn(length, 2, hidden_size, generator=g, dtype=torch.float64)
        fork.extend_context(hidden[: length // 2], 0)  # in two steps, as rounds commit
        fork.extend_context(hidden[length // 2 :], length // 2)
        forks.append(fork)
        token_ids.append(torch.randint(0, 60, (length + 1,), generator=g))
    return forks, token_ids


def block_log_probs(model: DFlashDraftModel, target: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """What a DFlash-lineage network drafts for one block after a random context: its draft
    log-probabilities [depth, head vocabulary] (its own head where it has one, else the target's),
    from random target taps and the anchor 5 followed by mask tokens. Two networks with the same
    weights and settings give identical rows; any difference in either changes them."""
    generator = torch.Generator().manual_seed(seed)
    context = 6
    hidden = target.config.hidden_size
    dtype = next(model.parameters()).dtype
    taps = torch.randn(1, context, len(model.target_layer_ids), hidden, generator=generator).to(dtype)
    block = torch.full((1, model.max_depth + model.anchor_rows), model.mask_token_id)
    block[0, 0] = 5
    head = getattr(model, "lm_head", None) or target.get_output_embeddings()
    with torch.no_grad():
        kv = model.context_kv(taps, torch.arange(context)[None])
        positions = torch.arange(context, context + block.shape[1])[None]
        states = model(target.get_input_embeddings()(block).to(dtype), positions, kv)
        return model.draft_log_probs(states[:, model.anchor_rows :], head, block[:, 0])[0]
