"""What differs between ``/v1/chat/completions`` and ``/v1/completions``: how a body becomes a
:class:`GenerationRequest`, and how generated text becomes that endpoint's OpenAI objects.
Everything else (errors, streaming, disconnects, metrics) is shared in :mod:`diffdraft.serve.app`."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, ClassVar

from diffdraft.generator import GenerationRequest, GenerationResult
from diffdraft.runtime.logprobs import TokenLogprob
from diffdraft.serve.protocol import (
    FINISH_REASONS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    DiffdraftStats,
    SamplingFields,
    TopLogprob,
    Usage,
    new_id,
    now,
)


class Endpoint:
    """One OpenAI endpoint's request model and response objects, for one request at a time."""

    path: ClassVar[str]
    body_model: ClassVar[type[SamplingFields]]
    id_prefix: ClassVar[str]

    def __init__(self, model_name: str, method: str, token_text: Callable[[int], str]) -> None:
        """``token_text``: one token's text, for log-probabilities."""
        self.model_name = model_name
        self.method = method
        self.token_text = token_text
        self.id = new_id(self.id_prefix)
        self.created = now()

    def generation_requests(self, body: Any, max_new_tokens: int) -> list[GenerationRequest]:
        """The generations a validated body asks for, one per choice, each of up to ``max_new_tokens``."""
        return [
            GenerationRequest(
                **self.prompt_input(body),
                max_new_tokens=max_new_tokens,
                temperature=body.sampling_temperature(),
                top_p=body.top_p if body.top_p is not None else 1.0,
                top_k=max(0, body.top_k or 0),
                seed=seed,
                stop=body.stop_strings(),
                ignore_eos=body.ignore_eos,
                logprobs=body.logprob_count(),
            )
            for seed in body.choice_seeds()
        ]

    def prompt_input(self, body: Any) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, results: list[GenerationResult], prompt_tokens: int) -> dict:
        """The whole response: a choice per result (usage counts the prompt once, as OpenAI's)."""
        raise NotImplementedError

    def chunks(
        self, index: int, text: str, first: bool, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict]:
        """Stream objects for choice ``index``'s newly generated text and the log-probabilities of
        the tokens that made it, if asked for (``first``: nothing of that choice was sent yet)."""
        raise NotImplementedError

    def last_chunk(self, index: int, result: GenerationResult) -> dict:
        """The object that carries a choice's finish reason (and its ``diffdraft`` stats)."""
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> dict:
        """With ``stream_options.include_usage``: no choices, the token counts."""
        raise NotImplementedError

    def _top(self, token: TokenLogprob) -> list[TopLogprob]:
        return [self._entry(t, lp) for t, lp in token.top]

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def stats(self, result: GenerationResult) -> DiffdraftStats:
        s = result.stats
        return DiffdraftStats(
            method=self.method,
            rounds=s.rounds,
            tau=s.tau,
            acceptance_lengths=s.acceptance_lengths,
            stop_reason=s.stop_reason,
        )


def _absent(stats: DiffdraftStats | None) -> dict:
    """Fields a stream chunk leaves out: usage (its own chunk), the stats until a choice's last
    chunk, and the per-choice stats of whole responses."""
    absent: dict = {"usage": True, "choices": {"__all__": {"diffdraft"}}}
    if stats is None:
        absent["diffdraft"] = True
    return absent


def finish_reason(result: GenerationResult) -> str:
    return FINISH_REASONS.get(result.stats.stop_reason, "stop")


def usage_of(results: list[GenerationResult], prompt_tokens: int) -> Usage:
    """A request's token counts: its prompt once (as OpenAI counts it), every choice's tokens."""
    return Usage.of(prompt_tokens, sum(len(r.token_ids) for r in results))


class ChatEndpoint(Endpoint):
    path = "/v1/chat/completions"
    body_model = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def prompt_input(self, body: ChatCompletionRequest) -> dict[str, Any]:
        return {"messages": body.chat_messages()}

    def response(self, results: list[GenerationResult], prompt_tokens: int) -> dict:
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=result.text),
                    logprobs=self._logprobs(result.logprobs),
                    finish_reason=finish_reason(result),
                    diffdraft=self.stats(result),
                )
                for i, result in enumerate(results)
            ],
            usage=usage_of(results, prompt_tokens),
            diffdraft=self.stats(results[0]),
        ).model_dump()

    def _logprobs(self, tokens: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if tokens is None:
            return None
        content = [
            ChatTokenLogprob(**self._entry(t.token_id, t.logprob).model_dump(), top_logprobs=self._top(t))
            for t in tokens
        ]
        return ChatLogprobs(content=content)

    def _chunk(
        self,
        index: int,
        delta: Delta,
        finish: str | None = None,
        stats: DiffdraftStats | None = None,
        logprobs: ChatLogprobs | None = None,
    ) -> dict:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)],
            diffdraft=stats,
        )
        return chunk.model_dump(exclude=_absent(stats))

    def chunks(
        self, index: int, text: str, first: bool, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict]:
        out = [self._chunk(index, Delta(role="assistant", content=""))] if first else []
        if text or logprobs:
            out.append(self._chunk(index, Delta(content=text), logprobs=self._logprobs(logprobs)))
        return out

    def last_chunk(self, index: int, result: GenerationResult) -> dict:
        return self._chunk(index, Delta(), finish_reason(result), self.stats(result))

    def usage_chunk(self, usage: Usage) -> dict:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model_name, choices=[], usage=usage
        ).model_dump(exclude={"diffdraft"})


class CompletionEndpoint(Endpoint):
    path = "/v1/completions"
    body_model = CompletionRequest
    id_prefix = "cmpl"

    def __init__(self, model_name: str, method: str, token_text: Callable[[int], str]) -> None:
        super().__init__(model_name, method, token_text)
        self.offsets: dict[int, int] = {}
        """Per streamed choice: where its next token's text starts (``text_offset``)."""

    def prompt_input(self, body: CompletionRequest) -> dict[str, Any]:
        return body.prompt_input()

    def response(self, results: list[GenerationResult], prompt_tokens: int) -> dict:
        return Completion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=result.text,
                    logprobs=self._logprobs(result.logprobs, 0),
                    finish_reason=finish_reason(result),
                    diffdraft=self.stats(result),
                )
                for i, result in enumerate(results)
            ],
            usage=usage_of(results, prompt_tokens),
            diffdraft=self.stats(results[0]),
        ).model_dump()

    def _logprobs(self, tokens: list[TokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        if tokens is None:
            return None
        texts = [self.token_text(t.token_id) for t in tokens]
        starts = list(itertools.accumulate(map(len, texts), initial=offset))[:-1]
        return CompletionLogprobs(
            tokens=texts,
            token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[{e.token: e.logprob for e in self._top(t)} for t in tokens],
            text_offset=starts,
        )

    def _chunk(
        self,
        index: int,
        text: str,
        finish: str | None = None,
        stats: DiffdraftStats | None = None,
        logprobs: CompletionLogprobs | None = None,
    ) -> dict:
        chunk = Completion(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)],
            diffdraft=stats,
        )
        return chunk.model_dump(exclude=_absent(stats))

    def chunks(
        self, index: int, text: str, first: bool, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict]:
        if not (text or logprobs):
            return []
        entries = self._logprobs(logprobs, self.offsets.get(index, 0))
        if entries is not None and entries.tokens:
            self.offsets[index] = entries.text_offset[-1] + len(entries.tokens[-1])
        return [self._chunk(index, text, logprobs=entries)]

    def last_chunk(self, index: int, result: GenerationResult) -> dict:
        return self._chunk(index, "", finish_reason(result), self.stats(result))

    def usage_chunk(self, usage: Usage) -> dict:
        return Completion(
            id=self.id, created=self.created, model=self.model_name, choices=[], usage=usage
        ).model_dump(exclude={"diffdraft"})
