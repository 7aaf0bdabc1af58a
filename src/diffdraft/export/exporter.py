"""``export_drafter``: check that an engine can run a drafter (DFlash, DFlash2 or DSpark), then write
what it loads (a directory for vLLM and SGLang, one GGUF file for llama.cpp).

Every check runs before anything is written (the output path first, so a wrong ``--out`` is
refused before any model is loaded).
"""

from __future__ import annotations

import os
from pathlib import Path

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.families import check_compatible
from diffdraft.errors import IncompatibleDrafterError
from diffdraft.export import llamacpp, sglang, vllm
from diffdraft.export.layout import Engine, Export, check_family, check_taps, without_draft_vocabulary
from diffdraft.export.output import check_out_dir, write_export
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel

ENGINES: dict[str, Engine] = {"vllm": vllm.ENGINE, "sglang": sglang.ENGINE, llamacpp.FORMAT: llamacpp.ENGINE}
"""The --format choices."""


def export_drafter(
    drafter: str | os.PathLike,
    engine: str,
    out: str | os.PathLike,
    force: bool = False,
    target: str | os.PathLike | None = None,
    full_vocabulary: bool = False,
) -> Export:
    """Export ``drafter`` (a checkpoint directory or a shipped name) for ``engine`` into ``out``.

    ``target`` (a model directory, .gguf file or 'default') is optional for vLLM and SGLang: with it
    the drafter is checked against the target it will serve, and the parts of the export that come
    from the target are filled in (vLLM: the draft vocabulary's LM head rows; SGLang: the mask
    token's text). llama.cpp needs it, as a .gguf file: its draft GGUF carries the target's tokenizer.
    For llama.cpp ``out`` names the .gguf file to write; otherwise a directory. ``full_vocabulary``
    drops a draft vocabulary (:func:`~diffdraft.export.layout.without_draft_vocabulary`).
    Raises ExportError (the engine cannot run the drafter) or InvalidRequestError (bad ``out``).
    """
    spec = ENGINES[engine]
    out = Path(out).expanduser()
    if engine == llamacpp.FORMAT:
        return _export_gguf(drafter, out, force, target, full_vocabulary)
    check_out_dir(out, force)
    model = check_family(load_draft_model(drafter), spec.name)  # before loading a target
    if full_vocabulary:
        model = without_draft_vocabulary(model)
    loaded = load_target(target, "auto", "cpu") if target is not None else None
    depth = getattr(model.config, "num_target_layers", None)
    if loaded is not None:
        checked = TargetModel(loaded.model)
        check_compatible(model, checked)
        depth = checked.num_layers
    check_taps(model, spec.name, depth)
    export = spec.build(model, loaded)
    write_export(export, out)
    return export


def _export_gguf(
    drafter: str | os.PathLike,
    out: Path,
    force: bool,
    target: str | os.PathLike | None,
    full_vocabulary: bool,
) -> llamacpp.GGUFExport:
    """llama.cpp: the drafter and the target's GGUF (read directly, not loaded) into one GGUF file."""
    llamacpp.check_out_file(out, force)
    path = llamacpp.target_file(target)
    model = check_family(load_draft_model(drafter), llamacpp.FORMAT)
    if full_vocabulary:
        model = without_draft_vocabulary(model)
    gguf = llamacpp.read_target(path, need_head=llamacpp.needs_target_head(model))
    vocab = model.config.vocab_size
    if gguf.vocab_size != vocab:
        raise IncompatibleDrafterError(
            f"the target GGUF's vocabulary has {gguf.vocab_size} tokens, the drafter's {vocab}: export "
            "the drafter trained for this target"
        )
    check_taps(model, llamacpp.FORMAT, gguf.num_layers)
    export = llamacpp.build(model, gguf)
    llamacpp.write(export, out)
    return export
