"""When generation ends: end tokens, stop strings, the token budget and the context length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diffdraft.errors import InvalidRequestError


@dataclass
class StopDecision:
    keep: int
    """How many generated tokens to keep (the rest of the round is dropped)."""
    reason: str
    """"eos", "stop_string", "max_new_tokens" or "context_length"."""


class StopConditions:
    """Checked after every round on the whole generated sequence so far."""

    def __init__(
        self,
        end_token_ids: Sequence[int],
        max_new_tokens: int,
        max_total_tokens: int,
        prompt_length: int,
        stop_strings: Sequence[str] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if prompt_length >= max_total_tokens:
            raise InvalidRequestError(
                f"the prompt has {prompt_length} tokens but the target's context holds {max_total_tokens}: "
                "shorten the prompt (or the chat history) so at least one new token fits"
            )
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        if stop_strings and decode is None:
            raise InvalidRequestError("stop strings need a tokenizer to decode the output")
        self.end_token_ids = frozenset(end_token_ids)
        self.max_new_tokens = min(max_new_tokens, max_total_tokens - prompt_length)
        self.budget_reason = "max_new_tokens" if max_new_tokens <= self.max_new_tokens else "context_length"
        self.stop_strings = list(stop_strings)
        self.decode = decode

    def remaining(self, generated: int) -> int:
        return self.max_new_tokens - generated

    def check(self, generated: list[int], new: int) -> StopDecision | None:
        """Decide after ``new`` tokens were appended to ``generated``."""
        first_new = len(generated) - new
        for i in range(first_new, len(generated)):
            if generated[i] in self.end_token_ids:
                return StopDecision(i + 1, "eos")
        if self.stop_strings:
            keep = self._stop_string_end(generated, first_new)
            if keep is not None:
                return StopDecision(keep, "stop_string")
        if len(generated) >= self.max_new_tokens:
            return StopDecision(self.max_new_tokens, self.budget_reason)
        return None

    def _stop_string_end(self, generated: list[int], first_new: int) -> int | None:
        """Fewest tokens whose text contains a stop string, if the new tokens completed one."""
        if not any(s in self.decode(generated) for s in self.stop_strings):
            return None
        for keep in range(max(first_new, 1), len(generated) + 1):
            text = self.decode(generated[:keep])
            if any(s in text for s in self.stop_strings):
                return keep
        return len(generated)

    def cut_text(self, text: str) -> str:
        """Text up to (not including) the first stop string, as OpenAI-style APIs return it."""
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=len(text))
        return text[:cut]
