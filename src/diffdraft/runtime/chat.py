"""Turn a request (chat messages or a plain prompt) into the token ids the engine prefills.

Validation happens here, before any model work, so a malformed request fails with a message that
shows the expected shape instead of a Jinja or tokenizer traceback.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from diffdraft.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")
_SHAPE = "[{'role': 'user', 'content': 'Hello'}, ...] with role one of " + ", ".join(ROLES)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Render the messages with the tokenizer's chat template, ending with the assistant's turn opener."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            f"messages must be a non-empty list like {_SHAPE}; got {reprlib.repr(messages)}"
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise InvalidRequestError(
                f"messages[{index}] must be a dict with a 'role' and a string 'content', as in {_SHAPE}; "
                f"got {reprlib.repr(message)}"
            )
        require_utf8(message["content"], f"messages[{index}]['content']")
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model's tokenizer has no chat template, so it cannot take chat messages; "
            "pass a plain prompt instead"
        )
    try:
        ids = tokenizer.apply_chat_template(
            [dict(message) for message in messages], add_generation_prompt=True, return_dict=False
        )
    except TemplateError as error:
        raise InvalidRequestError(f"the model's chat template rejected these messages: {error}") from error
    return [int(token) for token in ids]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize the text as given: no template, and only the BOS the tokenizer would add by itself.

    Other special tokens a tokenizer appends by default (an EOS) would end the prompt, so they are
    dropped.
    """
    if not isinstance(text, str) or not text:
        raise InvalidRequestError(f"prompt must be a non-empty string; got {reprlib.repr(text)}")
    require_utf8(text, "prompt")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InvalidRequestError(f"prompt {reprlib.repr(text)} encodes to no tokens; pass some text")
    bos = tokenizer.bos_token_id
    with_specials = tokenizer(text)["input_ids"]
    if bos is not None and with_specials[:1] == [bos] and ids[:1] != [bos]:
        ids = [bos, *ids]
    return list(ids)


def require_utf8(text: str, what: str) -> None:
    """Refuse text that has no UTF-8 form, which the tokenizer rejected with a TypeError traceback:
    lone surrogates, the form invalid bytes take in a command-line argument (Python decodes argv with
    ``surrogateescape``) and what an unpaired ``\\udXXX`` escape in JSON decodes to."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = text[error.start]
        if 0xDC80 <= ord(char) <= 0xDCFF:  # surrogateescape's stand-in for an undecodable byte
            found = f"a byte that is not UTF-8 ({ord(char) - 0xDC00:#04x}; or an unpaired surrogate {char!r})"
        else:
            found = f"an unpaired surrogate {char!r} (half of a UTF-16 pair)"
        raise InvalidRequestError(
            f"{what} is not valid UTF-8 text: it has {found} at character {error.start}; pass the text "
            "as UTF-8 (e.g. convert it with iconv -t UTF-8)"
        ) from error
