"""The DEER draft network: a small masked-diffusion LM that reads tokens only (DEER, arXiv 2512.15176).

Unlike DFlash and DART it never sees the target's hidden states, so one drafter serves every target
that shares its tokenizer. It is built from a Hugging Face causal LM (``diffdraft deer init``: the
first N layers, the embedding and the head) and keeps that LM's module and weight names, so the
checkpoint is the base LM's layout plus ``deer_config``.

No public DEER code exists; the block layout is ours, chosen so that the base LM's knowledge is
used from step 0 (the shifted logits that AR-initialised diffusion LMs such as Dream keep):

* the committed prefix is causal, exactly as in the base LM, so its keys/values are cached once;
* the last committed token's row predicts depth 1 (at initialisation: the truncated base LM);
* ``block_size - 1`` rows holding the mask token follow; they see the whole prefix and one
  another (bidirectionally) and predict depths 2..block_size.

Every drafted position is conditioned on the prefix alone (DEER's within-block independence,
its Sec. 3.2), and one forward gives all ``block_size`` per-position distributions. Optionally
(``deer_config.denoising_steps`` S > 1) the drafter denoises in S forwards, each filling the most
confident still-masked positions with their argmax (:mod:`diffdraft.drafters.deer`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

DEER = "deer"
ARCHITECTURE = "DEERDraftModel"


def is_deer_config(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or [])


def deer_config_from(raw: dict) -> PretrainedConfig:
    """The base LM's config class, built from a DEER ``config.json`` (``model_type`` names it)."""
    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError("a DEER config must record the base LM's model_type (e.g. 'llama')")
    return AutoConfig.for_model(model_type, **raw)


def make_deer_config(
    base: PretrainedConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    tokenizer_fingerprint: str | None,
    initialized_from: str,
    denoising_steps: int = 1,
) -> PretrainedConfig:
    """A copy of ``base`` cut to ``num_layers`` layers, carrying DEER's settings in ``deer_config``.

    A base with sliding windows (Gemma 3) gives a drafter whose windows span its whole context: its
    blocks attend bidirectionally over everything before them in training and drafting alike, and a
    block's positions are not a tree's, which the windowed masks of
    :meth:`~diffdraft.target.model.TargetModel.attention_mask` assume. Each layer keeps its type, so its
    rotary base (Gemma 3's local and global) stays the one it learnt."""
    config = base.__class__(**base.to_dict())
    base_architectures = list(getattr(base, "architectures", None) or [])
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = config.max_position_embeddings
    config.architectures = [ARCHITECTURE]
    config.deer_config = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "base_architectures": base_architectures,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "initialized_from": initialized_from,
        "denoising_steps": denoising_steps,
    }
    return config


class DEERDraftModel(nn.Module):
    """A causal LM's modules (``model``, ``lm_head``) plus DEER's block settings.

    ``forward`` takes a custom 4D attention mask (see the module docstring for the layout); the
    drafter at inference (:mod:`diffdraft.drafters.deer`) and the training objective
    (:mod:`diffdraft.train.deer_objective`) build it.
    """

    variant = DEER
    draft_vocab = None
    """It scores the whole vocabulary with its own head."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        settings = getattr(config, "deer_config", None) or {}
        for key in ("block_size", "mask_token_id"):
            if key not in settings:
                raise ValueError(f"deer_config.{key} is missing")
        self.config = config
        self.target_layer_ids: list[int] = []  # it taps no target layer: it reads tokens only
        self.block_size = int(settings["block_size"])
        self.mask_token_id = int(settings["mask_token_id"])
        self.tokenizer_fingerprint: str | None = settings.get("tokenizer_fingerprint")
        self.denoising_steps = int(settings.get("denoising_steps", 1))
        if self.block_size < 1:
            raise ValueError(f"deer_config.block_size must be >= 1, got {self.block_size}")
        if self.denoising_steps < 1:
            raise ValueError(f"deer_config.denoising_steps must be >= 1, got {self.denoising_steps}")
        if not 0 <= self.mask_token_id < config.vocab_size:
            raise ValueError(
                f"deer_config.mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"({config.vocab_size})"
            )
        causal_lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self._causal_lm = [causal_lm]  # a list, so its modules are registered once, under our names

    @property
    def causal_lm(self) -> PreTrainedModel:
        """The base LM's class around these modules (what the cached inference forward runs)."""
        return self._causal_lm[0]

    @property
    def max_depth(self) -> int:
        return self.block_size

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """Final hidden states [b, n, H] of rows ``input_ids`` [b, n] under ``attention_mask``
        [b, 1, n, n] (bool, True = may attend), without a cache (training)."""
        additive = torch.zeros(attention_mask.shape, dtype=self.lm_head.weight.dtype, device=input_ids.device)
        additive.masked_fill_(~attention_mask, torch.finfo(additive.dtype).min)
        return self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=additive, use_cache=False
        ).last_hidden_state

    def state_dict(self, *args, **kwargs):
        """The base LM's weight names; a head tied to the embedding is stored once (as Hugging Face)."""
        state = super().state_dict(*args, **kwargs)
        if self.tied:
            state.pop(kwargs.get("prefix", "") + "lm_head.weight", None)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.tied and "lm_head.weight" not in state_dict:
            state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.tied:
            self.causal_lm.tie_weights()
        return result


def deer_from_causal_lm(
    causal_lm: PreTrainedModel,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    tokenizer_fingerprint: str | None,
    initialized_from: str,
    denoising_steps: int = 1,
) -> DEERDraftModel:
    """A DEER drafter whose embedding, first ``num_layers`` layers, final norm and head are copies of
    ``causal_lm``'s (DEER built its math drafter from Qwen2.5-0.5B the same way)."""
    base = (
        causal_lm.config.get_text_config()
        if hasattr(causal_lm.config, "get_text_config")
        else causal_lm.config
    )
    available = base.num_hidden_layers
    if not 1 <= num_layers <= available:
        raise ValueError(
            f"num_layers must be in [1, {available}] (the base LM's layer count), got {num_layers}"
        )
    config = make_deer_config(
        base, num_layers, block_size, mask_token_id, tokenizer_fingerprint, initialized_from, denoising_steps
    )
    drafter = DEERDraftModel(config)
    source = {k: v.detach().float().cpu() for k, v in causal_lm.state_dict().items()}
    wanted = drafter.state_dict()
    missing = sorted(set(wanted) - set(source))
    if missing:
        raise ValueError(f"the base LM lacks weights the drafter needs: {missing[:6]}")
    drafter.load_state_dict({k: source[k] for k in wanted})
    return drafter
