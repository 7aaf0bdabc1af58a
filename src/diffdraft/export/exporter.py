"""``export_drafter``: check that an engine can run a drafter, then write the directory it loads.

Every check runs before anything is written (the output directory first, so a wrong ``--out`` is
refused before any model is loaded).
"""

from __future__ import annotations

import os
from pathlib import Path

from diffdraft.drafters.checkpoint import load_draft_model
from diffdraft.drafters.families import check_compatible
from diffdraft.export import sglang, vllm
from diffdraft.export.layout import Engine, Export, check_family, check_taps
from diffdraft.export.output import check_out_dir, write_export
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel

ENGINES: dict[str, Engine] = {"vllm": vllm.ENGINE, "sglang": sglang.ENGINE}
"""The --format choices."""


def export_drafter(
    drafter: str | os.PathLike,
    engine: str,
    out: str | os.PathLike,
    force: bool = False,
    target: str | os.PathLike | None = None,
) -> Export:
    """Export ``drafter`` (a checkpoint directory or a shipped name) for ``engine`` into ``out``.

    ``target`` (a model directory, .gguf file or 'default') is optional: with it the drafter is
    checked against the target it will serve, and the parts of the export that come from the target
    are filled in (vLLM: the draft vocabulary's LM head rows; SGLang: the mask token's text).
    Raises ExportError (the engine cannot run the drafter) or InvalidRequestError (bad ``out``).
    """
    spec = ENGINES[engine]
    out = Path(out).expanduser()
    check_out_dir(out, force)
    model = check_family(load_draft_model(drafter), spec.name)  # before loading a target
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
