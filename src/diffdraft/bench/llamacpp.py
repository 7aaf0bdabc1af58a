"""llama.cpp as a benchmark row: the engine CPU users already run, on the same GGUF weights.

Runs through ``llama-cpp-python`` (the optional extra ``diffdraft[llamacpp]``; it builds llama.cpp
from source), fed the same prompt token ids, token budget, end tokens and thread count as our rows.
``llama.cpp`` decodes the target's own GGUF file as it is (the default target's is Q4_1);
``llama.cpp:bf16`` / ``llama.cpp:f32`` decode a dense copy of the same weights
(:mod:`diffdraft.bench.gguf_precision`), our targets' precision. ``llama.cpp-pld`` adds the
binding's prompt lookup decoding (10 tokens, its default), llama.cpp's own lossless speculation.

Every ``eval`` call (one llama.cpp decode over the tokens fed) is timed: the first is the prefill,
each later one a round whose time is the ``verify_forward`` stage; sampling and the binding's Python
loop are ``other``. llama.cpp computes with its own kernels (Q4_1 activations are quantized to 8
bits), so its greedy tokens are not checked against our plain AR's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from diffdraft.bench.gguf_precision import DENSE_TYPES, dense_gguf
from diffdraft.bench.runner_api import STAGE_NAMES, Completion, MethodSpec, MethodUnavailable, Request

LOOKUP_TOKENS = 10
"""Tokens the binding's prompt lookup drafts per round (its default)."""
INSTALL = "pip install 'diffdraft[llamacpp]' (llama-cpp-python, which compiles llama.cpp: a few minutes)"


class LlamaCppRunner:
    """One llama.cpp model (``gguf``) generating like our runners: see the module docstring."""

    dtype = None  # another engine's weights and kernels: never compared token for token

    def __init__(
        self, spec: MethodSpec, gguf: str | os.PathLike, end_token_ids: Sequence[int], lookup: bool = False
    ) -> None:
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as error:
            raise MethodUnavailable(f"llama-cpp-python is not installed: {INSTALL}") from error
        if spec.arg not in (None, *DENSE_TYPES):
            raise MethodUnavailable(
                f"{spec.label}: the argument is the weights' precision, one of {', '.join(DENSE_TYPES)} "
                "(none: the GGUF file as it is)"
            )
        if spec.dtype is not None:
            raise MethodUnavailable(f"{spec.label}: llama.cpp rows take no @dtype; write {spec.name}:bf16")
        self.spec = spec
        self.path = Path(gguf) if spec.arg is None else dense_gguf(gguf, spec.arg)
        self.end_token_ids = set(end_token_ids)
        threads = torch.get_num_threads()
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
        self.llm = llama_cpp.Llama(
            model_path=str(self.path),
            n_ctx=0,  # the model's trained context
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            # drafting needs every position's logits; the binding sizes its logits buffer by this
            # argument, not by the draft model (without it, prompts past 512 tokens overflow it)
            logits_all=lookup,
            verbose=False,
        )
        self._eval = self.llm.eval
        self._calls: list[tuple[int, int, float]] = []
        """(tokens fed, tokens cached before, seconds) of each eval call of the current generation."""

    def generate(self, request: Request) -> Completion:
        """Greedy at temperature 0; otherwise llama.cpp's sampler with the request's T, top-p, top-k, seed."""
        self._calls = []
        # The binding reuses the cached prefix of the last generation's tokens: a repeat of the same
        # prompt would skip its prefill. Ours prefill every request, and so must this row.
        self.llm.reset()
        self.llm.eval = self._timed_eval  # the binding's generate loop calls self.eval
        tokens_after_call: list[int] = []
        token_ids: list[int] = []
        sampled = request.temperature > 0
        if sampled:
            self.llm.set_seed(request.seed)
        begin = time.perf_counter()
        try:
            for token in self.llm.generate(
                request.prompt_token_ids,
                temp=request.temperature,
                top_p=request.top_p if sampled else 1.0,
                top_k=request.top_k if sampled else 0,
                min_p=0.0,
                repeat_penalty=1.0,
                reset=True,
            ):
                token_ids.append(int(token))
                tokens_after_call += [0] * (len(self._calls) - len(tokens_after_call))
                tokens_after_call[-1] += 1
                if token in self.end_token_ids or len(token_ids) >= request.max_new_tokens:
                    break
        finally:
            seconds = time.perf_counter() - begin
            del self.llm.eval
        rounds = self._calls[1:]  # the first call is the prefill
        stages = dict.fromkeys(STAGE_NAMES, 0.0)
        stages["prefill"] = self._calls[0][2]
        stages["verify_forward"] = sum(s for *_, s in rounds)
        stages["other"] = max(0.0, seconds - stages["prefill"] - stages["verify_forward"])
        return Completion(
            token_ids=token_ids,
            seconds=seconds,
            acceptance_lengths=[max(1, n) for n in tokens_after_call[1:]],
            stages=stages,
            verify_sizes=[size for size, _, _ in rounds],
            verify_seconds=[s for *_, s in rounds],
            verify_contexts=[cached for _, cached, _ in rounds],
            draft_depths=[size - 1 for size, _, _ in rounds],
            engine="llama.cpp",
        )

    def _timed_eval(self, tokens: Sequence[int]) -> None:
        cached = self.llm.n_tokens
        begin = time.perf_counter()
        self._eval(tokens)
        self._calls.append((len(tokens), cached, time.perf_counter() - begin))
