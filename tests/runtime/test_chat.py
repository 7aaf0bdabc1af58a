"""Chat messages and plain prompts become the right token ids, and bad requests say what is expected."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from diffdraft.errors import InvalidRequestError
from diffdraft.runtime.chat import encode_chat, encode_prompt
from diffdraft.target.default_model import default_gguf_path

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
ID = {word: i for i, word in enumerate([*SPECIALS, "hello", "world", "system", "user", "assistant", "tool"])}
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' and loop.first %}"
    "{{ raise_exception('a tool reply needs a call first') }}"
    "{% endif %}"
    "<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tokenizer(template: str | None = TEMPLATE, post: str | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer; ``post`` is the default special-token template, e.g. ``"<s> $A"``."""
    backend = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if post:
        backend.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[("<s>", ID["<s>"]), ("</s>", ID["</s>"])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    )


def ids(text: str) -> list[int]:
    return [ID[word] for word in text.split()]


def test_chat_renders_the_template_with_a_generation_prompt() -> None:
    messages = [{"role": "system", "content": "world"}, {"role": "user", "content": "hello"}]
    expected = ids(
        "<|im_start|> system world <|im_end|> <|im_start|> user hello <|im_end|> <|im_start|> assistant"
    )
    assert encode_chat(tokenizer(), messages) == expected


def test_chat_accepts_every_role_a_tuple_and_extra_keys() -> None:
    messages = (
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world", "name": "bot"},
        {"role": "tool", "content": "hello"},
    )
    out = encode_chat(tokenizer(), messages)
    assert out[-2:] == ids("<|im_start|> assistant")
    assert out.count(ID["<|im_start|>"]) == 4


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (None, "non-empty list"),
        ({"role": "user", "content": "hello"}, "non-empty list"),
        (["hello"], r"messages\[0\]"),
        ([{"role": "user", "content": "hello"}, {"role": "bot", "content": "hi"}], r"messages\[1\]"),
        ([{"content": "hello"}], r"messages\[0\]"),
        ([{"role": "user"}], r"messages\[0\]"),
        ([{"role": "user", "content": ["hello"]}], r"messages\[0\]"),
    ],
)
def test_bad_messages_name_the_entry_and_the_shape(messages: object, where: str) -> None:
    with pytest.raises(InvalidRequestError, match=where) as info:
        encode_chat(tokenizer(), messages)
    assert "'role': 'user', 'content'" in str(info.value)


def test_long_bad_entries_are_abbreviated() -> None:
    with pytest.raises(InvalidRequestError) as info:
        encode_chat(tokenizer(), [{"role": "bot", "content": "x" * 100_000}])
    assert len(str(info.value)) < 400


def test_no_chat_template_asks_for_a_plain_prompt() -> None:
    with pytest.raises(InvalidRequestError, match="plain prompt"):
        encode_chat(tokenizer(template=None), [{"role": "user", "content": "hello"}])


def test_template_errors_become_request_errors() -> None:
    with pytest.raises(InvalidRequestError, match="tool reply needs a call first"):
        encode_chat(tokenizer(), [{"role": "tool", "content": "hello"}])


@pytest.mark.parametrize(
    ("post", "expected"),
    [
        (None, "hello world"),
        ("<s> $A", "<s> hello world"),
        ("$A </s>", "hello world"),  # an appended EOS would end the prompt before it starts
        ("<s> $A </s>", "<s> hello world"),
    ],
)
def test_prompt_gets_only_the_default_bos(post: str | None, expected: str) -> None:
    assert encode_prompt(tokenizer(post=post), "hello world") == ids(expected)


def test_prompt_that_already_starts_with_bos_is_not_doubled() -> None:
    assert encode_prompt(tokenizer(post="<s> $A"), "<s> hello") == ids("<s> hello")


@pytest.mark.parametrize("text", ["", "   ", None, ["hello"]])
def test_empty_or_non_text_prompt(text: object) -> None:
    with pytest.raises(InvalidRequestError, match="prompt"):
        encode_prompt(tokenizer(), text)


@pytest.mark.real_model
def test_smollm2_chat_template_renders() -> None:
    gguf = default_gguf_path()
    smol = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    out = encode_chat(smol, [{"role": "user", "content": "What is 2+2?"}])
    text = smol.decode(out)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert encode_prompt(smol, "What is 2+2?") == smol("What is 2+2?").input_ids


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("hello \udcff world", r"a byte that is not UTF-8 \(0xff; .*at character 6"),  # argv's bytes
        ("hello \ud83d world", r"an unpaired surrogate '\\ud83d' .*at character 6"),  # JSON's "\ud83d"
    ],
)
def test_text_without_a_utf8_form_is_named_and_valid_text_still_encodes(text: str, found: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"prompt is not valid UTF-8 text: it has {found}"):
        encode_prompt(tokenizer(), text)
    message = f"messages\\[1\\]\\['content'\\] is not valid UTF-8 text: it has {found}"
    with pytest.raises(InvalidRequestError, match=message):
        encode_chat(tokenizer(), [{"role": "system", "content": "hello"}, {"role": "user", "content": text}])
    assert encode_prompt(tokenizer(), "hello wörld") == ids("hello <unk>")  # UTF-8 beyond ASCII is fine
