"""Export for llama.cpp's DFlash speculative decoding (``--spec-type draft-dflash``): one GGUF file.

What llama.cpp reads, from its source (ggml-org/llama.cpp as vendored by llama-cpp-python 0.3.36,
read for facts only; paths are relative to its root):

* ``src/llama-arch.cpp``, ``gguf-py/gguf/constants.py``: the architecture is ``dflash``; its keys are
  ``dflash.block_size``, ``dflash.target_layers`` and the usual ``dflash.*`` sizes; tensor names
  ``fc``, ``enc.output_norm`` (our ``hidden_norm``), ``output_norm`` (our ``norm``),
  ``blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,attn_q_norm,attn_k_norm,ffn_norm,ffn_gate,
  ffn_up,ffn_down}``, ``output`` and ``d2t``.
* ``src/models/dflash.cpp`` (``load_arch_hparams``, ``load_arch_tensors``, the graph): ``target_layers``
  is required; ``fc`` is ``[taps * n_embd, n_embd]``; no biases; ``token_embd`` / ``output`` are
  optional (absent: the target's are used); a ``d2t`` tensor (I64, absolute target ids) makes
  ``output`` the draft vocabulary's head and scatters its logits to those ids; the context is
  ``enc.output_norm(fc(features))`` projected by each layer's ``attn_k`` / ``attn_v``, as ours.
* ``conversion/qwen.py`` (``DFlashModel``): ``target_layers`` holds DFlash id + 1, the tokenizer is
  the target's, ``tokenizer.ggml.mask_token_id`` is ``dflash_config.mask_token_id``.
* ``common/speculative.cpp`` (``common_speculative_impl_draft_dflash``): the mask id comes from the
  draft's vocabulary, so the draft GGUF needs the target's tokenizer; the target captures the input
  of layer ``target_layers[k]``; at most ``block_size - 1`` tokens are drafted.
* ``src/llama-context.cpp``, ``src/models/*.cpp``: layer inputs are captured only by the target
  architectures in :data:`EXTRACTING_ARCHITECTURES`; the output of the last layer is captured by a
  few before the final norm, never after it (where diffdraft reads it), so that tap is refused.
* ``src/llama-model.cpp`` (``llama_model_rope_type``): a dflash draft ropes NeoX style (rotate half,
  as ours), so q/k need no permutation.

DFlash2 and DSpark drafters are the same architecture with more keys and tensors
(:mod:`diffdraft.export.dflash2`, :mod:`diffdraft.export.dspark`); ``common/speculative.cpp`` tells a
DSpark draft by its ``markov_w1.weight`` tensor and runs it as ``--spec-type draft-dspark``, drafting
``block_size`` tokens when its anchor row predicts.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffdraft.drafters.dflash_model import DFlashDraftModel
from diffdraft.drafters.families import DFLASH2_FAMILY, DFLASH_FAMILY, DSPARK_FAMILY, DraftModel, family_of
from diffdraft.errors import ExportError, InvalidRequestError
from diffdraft.export import dflash2, dspark
from diffdraft.export.layout import Engine, Export, capture_point, drafted_tokens, serving_config
from diffdraft.util.staging import temp_dir_beside

ARCH = "dflash"
FORMAT = "llama.cpp"
EXTRACTING_ARCHITECTURES = frozenset(
    {
        "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "gemma4",
        "gpt-oss", "lfm2", "nemotron_h", "mimo2", "minimax-m2", "minimax-01", "bailingmoe3",
        "deepseek4", "hunyuan_vl", "nanbeige", "muse-glimmer",
    }
)  # fmt: skip
"""GGUF architectures whose llama.cpp graph records the layer inputs a DFlash draft reads
(``res->t_layer_inp[il]`` in ``src/models/<arch>.cpp``)."""

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
"""Our layer weights by llama.cpp's ``blk.N.*`` names."""
TOP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
ACTIVATIONS = {"silu", "gelu", "gelu_pytorch_tanh"}
"""What ``load_arch_hparams`` accepts for ``dflash.hidden_activation``."""


@dataclass
class TargetGGUF:
    """What the export reads from the target's GGUF file (the file llama.cpp serves)."""

    path: Path
    architecture: str
    num_layers: int
    hidden_size: int
    tokenizer: list  # gguf ReaderFields of the tokenizer.* keys
    vocab_size: int
    head: np.ndarray | None = None  # the LM head [vocab, hidden], read only for a draft vocabulary


NAMES = {DFLASH_FAMILY.key: "DFlash", DFLASH2_FAMILY.key: "DFlash2", DSPARK_FAMILY.key: "DSpark"}
"""How ``general.name`` names each family's drafter."""


@dataclass
class GGUFExport(Export):
    """The GGUF's metadata (key -> value) besides the tokenizer, and tensors by GGUF name; ``config``
    is the drafter's Hugging Face serving config (what the CLI reports)."""

    metadata: dict
    target: TargetGGUF
    name: str = "diffdraft DFlash drafter"


def check_out_file(out: Path, force: bool) -> None:
    """``--out`` names the .gguf file to write; refuse a directory, another suffix, or an existing
    file without ``force``, before any work is done."""
    if out.is_dir():
        raise InvalidRequestError(
            f"--out {out} is a directory; for --format llama.cpp --out names the GGUF file to write, "
            "e.g. --out drafter.gguf"
        )
    if out.suffix.lower() != ".gguf":
        raise InvalidRequestError(
            f"--out {out} does not end in .gguf; for --format llama.cpp --out names the GGUF file to "
            "write, e.g. --out drafter.gguf"
        )
    if out.exists() and not force:
        raise InvalidRequestError(f"--out {out} exists; choose another --out, or pass --force to replace it")


def target_file(target: str | os.PathLike | None) -> Path:
    """The target's GGUF path: llama.cpp's draft GGUF carries the target's tokenizer (its mask id)."""
    from diffdraft.target.default_model import default_gguf_path

    if target is None:
        raise ExportError(
            "llama.cpp reads the mask token from the draft GGUF's own tokenizer, which must be the "
            "target's: pass --target TARGET.gguf (the GGUF llama.cpp serves, or 'default')"
        )
    path = default_gguf_path() if str(target) == "default" else Path(target).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ExportError(
            f"--target {target} is not a .gguf file; llama.cpp serves GGUF targets and the draft takes "
            "its tokenizer from one: pass --target TARGET.gguf (or 'default')"
        )
    return path


def read_target(path: Path, need_head: bool) -> TargetGGUF:
    """The target GGUF's architecture, depth, width, tokenizer and (``need_head``) LM head."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = reader.fields

    def value(key: str):
        if key not in fields:
            raise ExportError(f"the target GGUF {path} has no {key}; pass the GGUF llama.cpp serves")
        return fields[key].contents()

    arch = value("general.architecture")
    tokenizer = [field for name, field in fields.items() if name.startswith("tokenizer.")]
    target = TargetGGUF(
        path=path,
        architecture=arch,
        num_layers=int(value(f"{arch}.block_count")),
        hidden_size=int(value(f"{arch}.embedding_length")),
        tokenizer=tokenizer,
        vocab_size=len(value("tokenizer.ggml.tokens")),
    )
    if need_head:
        tensors = {t.name: t for t in reader.tensors}
        head = tensors.get("output.weight") or tensors.get("token_embd.weight")
        if head is None:
            raise ExportError(f"the target GGUF {path} has no output.weight or token_embd.weight")
        from gguf import quants

        target.head = quants.dequantize(head.data, head.tensor_type).reshape(-1, target.hidden_size)
    return target


def needs_target_head(model: DraftModel) -> bool:
    """Whether the export copies rows of the target's LM head: a DFlash draft vocabulary's (DSpark's
    reduced vocabulary ships its own head)."""
    return family_of(model) is DFLASH_FAMILY and model.draft_vocab is not None


def check_target(model: DFlashDraftModel, target: TargetGGUF) -> None:
    """Refuse a target llama.cpp extracts no features from, or one the drafter was not sized for."""
    if target.architecture not in EXTRACTING_ARCHITECTURES:
        raise ExportError(
            f"llama.cpp captures no layer inputs for a {target.architecture!r} target, so a DFlash draft "
            "cannot run on it; serve it with --format vllm or sglang, or use a target of "
            + ", ".join(sorted(EXTRACTING_ARCHITECTURES))
        )
    if target.hidden_size != model.config.hidden_size:
        raise ExportError(
            f"the target's hidden size is {target.hidden_size}, the drafter's {model.config.hidden_size}: "
            "export the drafter trained for this target"
        )
    mask = model.mask_token_id
    if not 0 <= mask < target.vocab_size:
        raise ExportError(
            f"mask_token_id {mask} lies outside the target's vocabulary of {target.vocab_size} tokens, so "
            "llama.cpp cannot feed it: retrain with a mask token of the target (diffdraft train fit)"
        )


def check_config(model: DFlashDraftModel) -> None:
    """Refuse what llama.cpp's dflash graph does not compute: biases, other activations, rope kinds."""
    config = model.config
    if getattr(config, "attention_bias", False):
        raise ExportError("the drafter's attention has biases, which llama.cpp's dflash graph has not")
    if config.hidden_act not in ACTIVATIONS:
        raise ExportError(
            f"the drafter's activation {config.hidden_act!r} is not one llama.cpp's dflash runs "
            f"({', '.join(sorted(ACTIVATIONS))})"
        )
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ExportError(
            f"the drafter's rope {rope} is not written by this export (plain RoPE only); "
            "export it with --format vllm or sglang"
        )


def build(model: DraftModel, target: TargetGGUF) -> GGUFExport:
    """The GGUF's metadata and tensors: our weights under llama.cpp's names, 1-D norms and DFlash2's
    base kernels as float32, plus each family's own keys and tensors."""
    check_config(model)
    check_target(model, target)
    family = family_of(model)
    config = model.config
    rope = dict(getattr(config, "rope_parameters", None) or {})
    metadata = {
        f"{ARCH}.context_length": int(config.max_position_embeddings),
        f"{ARCH}.embedding_length": int(config.hidden_size),
        f"{ARCH}.block_count": int(config.num_hidden_layers),
        f"{ARCH}.feed_forward_length": int(config.intermediate_size),
        f"{ARCH}.attention.head_count": int(config.num_attention_heads),
        f"{ARCH}.attention.head_count_kv": int(config.num_key_value_heads),
        f"{ARCH}.attention.key_length": int(config.head_dim),
        f"{ARCH}.attention.value_length": int(config.head_dim),
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{ARCH}.attention.causal": False,
        f"{ARCH}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{ARCH}.hidden_activation": str(config.hidden_act),
        f"{ARCH}.block_size": int(model.block_size),
        f"{ARCH}.target_layers": [capture_point(i) for i in model.target_layer_ids],
        "tokenizer.ggml.mask_token_id": int(model.mask_token_id),
    }
    if family is DFLASH2_FAMILY:
        metadata |= dflash2.gguf_metadata(model, ARCH)
        serving = dflash2.serving_config(model)
    elif family is DSPARK_FAMILY:
        metadata |= dspark.gguf_metadata(model, ARCH)
        serving = dspark.serving_config(model)
    else:
        serving = serving_config(model)
    tensors = _backbone_tensors(model)
    if family is DSPARK_FAMILY:
        tensors |= dspark.gguf_tensors(model)
    elif model.draft_vocab is not None:
        vocab = model.draft_vocab
        dtype = tensors["fc.weight"].dtype
        rows = torch.from_numpy(np.ascontiguousarray(target.head[vocab.cpu().numpy()]))
        tensors["output.weight"] = rows.to(dtype)
        tensors["d2t"] = vocab.cpu().to(torch.int64)  # absolute target ids, not vLLM's offsets
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and (tensor.dim() == 1 or name.endswith(dflash2.FLOAT_GGUF_NAMES)):
            tensors[name] = tensor.float()
    return GGUFExport(serving, tensors, metadata, target, f"diffdraft {NAMES[family.key]} drafter")


def _backbone_tensors(model: DraftModel) -> dict[str, torch.Tensor]:
    """The DFlash network's weights (and DFlash2's convs and selector) under llama.cpp's names; the
    heads DSpark adds are :func:`diffdraft.export.dspark.gguf_tensors`' business."""
    top = TOP_NAMES | dflash2.GGUF_TOP_NAMES
    layer_names = LAYER_NAMES | dflash2.GGUF_LAYER_NAMES
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name in top:
            gguf_name = top[name]
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        elif name == "draft_vocab" or name.startswith(dspark.HEAD_PREFIXES):
            continue  # written by build from the target's head, or by dspark.gguf_tensors
        else:
            raise ExportError(f"the drafter's weight {name} has no llama.cpp name in this export")
        tensors[gguf_name] = tensor.detach().cpu().contiguous()
    return tensors


def write(export: GGUFExport, out: Path) -> None:
    """Write the GGUF to a temporary file beside ``out``, renamed over it at the end."""
    staging = temp_dir_beside(out)
    try:
        tmp = staging / out.name
        _write_gguf(export, tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_gguf(export: GGUFExport, path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), ARCH)
    writer.add_name(export.name)
    for key, value in export.metadata.items():
        if key == "tokenizer.ggml.mask_token_id":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for field in export.target.tokenizer:
        if field.name == "tokenizer.ggml.mask_token_id":
            continue
        _copy_field(writer, field)
    writer.add_uint32("tokenizer.ggml.mask_token_id", export.metadata["tokenizer.ggml.mask_token_id"])
    for name, tensor in export.weights.items():
        if tensor.dtype == torch.bfloat16:
            raw = tensor.view(torch.int16).numpy().view(np.uint16)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.BF16)
        elif tensor.dtype == torch.int64:
            writer.add_tensor(name, tensor.numpy(), raw_dtype=GGMLQuantizationType.I64)
        else:
            writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_field(writer, field) -> None:
    """One metadata field of the target's GGUF, with its own value types."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
    else:
        writer.add_key_value(field.name, field.contents(), kind)


def launch(out: Path, config: dict, target: str) -> str:
    """``llama-server`` with the exported draft (docs/speculative.md's DFlash and DSpark examples);
    llama.cpp clamps n-max to the tokens a block drafts (``block_size - 1``, or ``block_size`` for a
    DSpark draft whose anchor row predicts), so that is what is asked for."""
    kind = "draft-dspark" if config["architectures"] == [dspark.ARCHITECTURE] else "draft-dflash"
    return (
        f"llama-server -m {shlex.quote(target)} -md {shlex.quote(str(out))} --spec-type {kind} "
        f"--spec-draft-n-max {drafted_tokens(config)} -fa on"
    )


ENGINE = Engine("llama.cpp", build, launch)  # type: ignore[arg-type]  # build takes a TargetGGUF
