"""Text of a growing token list without re-decoding all of it every round.

Streaming and stop strings need the generated text after every round. Decoding the whole output
each time costs O(length) per round, a noticeable share of a decoding round on a CPU once the
output is long (docs/decisions.md, "streaming text decoded from the newest tokens"). This decodes only
the newest tokens, with the previous round's tokens as context so tokenizers that drop a leading
space at the start of a decode (SentencePiece) or merge bytes across tokens still give the same
text as one full decode.
"""

from __future__ import annotations

from collections.abc import Callable

INCOMPLETE = "\ufffd"  # what a decode shows for a UTF-8 character cut between tokens
RESTART_CONTEXT = 4  # tokens of context kept after a full decode


class IncrementalDecoder:
    """``decoder(ids)`` returns ``decode(ids)``; cheaply when ``ids`` extends the previous call's.

    Invariant: ``self._text == decode(self._ids[:self._read])``. A call whose ids do not extend the
    previous ones (a shorter prefix, another sequence), or whose window does not decode as a
    continuation of its context, falls back to one full decode and restarts from there.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self._ids: list[int] = []
        self._text = ""
        self._context = 0  # first token of the decode window
        self._read = 0  # tokens whose text is in self._text

    def __call__(self, ids: list[int]) -> str:
        if len(ids) < self._read or ids[: self._read] != self._ids[: self._read]:
            return self.decode(list(ids))
        if len(ids) == self._read:  # asked again this round (stop strings, then the stream)
            return self._text
        known = self.decode(list(ids[self._context : self._read]))
        while not known and self._context > 0:  # context that shows no text (special tokens) is none
            self._context -= 1
            known = self.decode(list(ids[self._context : self._read]))
        window = self.decode(list(ids[self._context :]))
        if not window.startswith(known):
            return self._restart(ids)
        text = self._text + window[len(known) :]
        if not text.endswith(INCOMPLETE):  # hold a cut character until its last byte arrives
            self._ids, self._text = list(ids), text
            self._context, self._read = self._read, len(ids)
        return text

    def _restart(self, ids: list[int]) -> str:
        text = self.decode(list(ids))
        self._ids, self._text = list(ids), text
        self._context, self._read = max(0, len(ids) - RESTART_CONTEXT), len(ids)
        return text
