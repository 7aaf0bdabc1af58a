"""What a drafter or an n-gram trie records of the tokenizer it was built for, so loading it beside
another tokenizer (whose ids mean other text) is refused instead of drafting nonsense."""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of a tokenizer: its class, its token -> id map (sorted) and its added tokens.

    Two loads of the same tokenizer files give the same fingerprint; a different vocabulary, other
    added/special tokens or another tokenizer class give a different one.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    description = {
        "class": type(tokenizer).__name__,
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0])),
        "added": sorted(
            (int(index), str(token), bool(getattr(token, "special", False))) for index, token in added.items()
        ),
    }
    blob = json.dumps(description, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]
