"""Export DFlash drafters for serving engines with DFlash speculative decoding: vLLM, SGLang and
llama.cpp.

vLLM and SGLang load the official DFlash checkpoint layout (:mod:`diffdraft.export.layout`); llama.cpp
loads one GGUF file (:mod:`diffdraft.export.llamacpp`). Each engine module (also
:mod:`diffdraft.export.vllm`, :mod:`diffdraft.export.sglang`) says what that engine reads, cites the
source files the facts come from, and refuses what the engine cannot run.
"""

from diffdraft.export.exporter import ENGINES, export_drafter

__all__ = ["ENGINES", "export_drafter"]
