"""Request parsing and error descriptions of the OpenAI wire format, without a server."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from diffdraft.serve.protocol import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    Delta,
    describe_validation_error,
    error_body,
)

USER = {"role": "user", "content": "hi"}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": [USER], **fields}))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps(fields))


def problem(model, **fields) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(fields))
    return describe_validation_error(caught.value)


def test_defaults_leave_sampling_to_the_endpoint_and_allow_unknown_fields():
    request = chat(user="me", tool_choice="none", metadata={"a": 1})
    assert request.model is None and request.n == 1 and not request.stream
    assert request.temperature is None and request.max_tokens is None
    assert request.max_new_tokens(100) == 100
    assert request.unsupported() is None
    assert request.model_extra == {"user": "me", "tool_choice": "none", "metadata": {"a": 1}}


def test_choice_i_samples_with_seed_plus_i():
    assert chat(n=3, seed=10).choice_seeds() == [10, 11, 12]
    assert chat(n=2).choice_seeds() == [None, None]
    assert chat(n=2, seed=2**64 - 2).unsupported() is None


def test_log_probabilities_are_asked_for_in_each_endpoint_s_own_way():
    assert chat().logprob_count() is None and chat(logprobs=False, top_logprobs=0).logprob_count() is None
    assert chat(logprobs=True).logprob_count() == 0
    assert chat(logprobs=True, top_logprobs=5).logprob_count() == 5
    assert completion(prompt="a").logprob_count() is None
    assert completion(prompt="a", logprobs=3).logprob_count() == 3


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=9, max_completion_tokens=4).max_new_tokens(100) == 4
    assert chat(max_tokens=9).max_new_tokens(100) == 9


def test_stop_is_a_string_or_a_list():
    assert chat(stop="x").stop_strings() == ["x"]
    assert chat(stop=["a", "b"]).stop_strings() == ["a", "b"]
    assert chat().stop_strings() == []


def test_developer_messages_become_system_and_text_parts_are_joined():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        }
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
    ]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", {"prompt": "hello"}),
        (["hello"], {"prompt": "hello"}),
        ([5, 6, 7], {"prompt_token_ids": [5, 6, 7]}),
        ([[5, 6]], {"prompt_token_ids": [5, 6]}),
    ],
)
def test_a_completion_prompt_is_text_or_token_ids(prompt, expected):
    request = completion(prompt=prompt)
    assert request.unsupported() is None
    assert request.prompt_input() == expected


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (chat(n=2, seed=2**64 - 1), "seed"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(frequency_penalty=0.1), "frequency_penalty"),
        (chat(logit_bias={"5": 1.0}), "logit_bias"),
        (completion(prompt=["a", "b"]), "prompt"),
        (completion(prompt="a", echo=True), "echo"),
        (completion(prompt="a", suffix="z"), "suffix"),
        (completion(prompt="a", best_of=3), "best_of"),
    ],
)
def test_settings_the_server_cannot_honour_name_their_field(request_, field):
    assert request_.unsupported()[0] == field


def test_settings_at_their_neutral_value_are_accepted():
    assert (
        chat(logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={}).unsupported() is None
    )
    assert completion(prompt="a", logprobs=0, echo=False, best_of=1).unsupported() is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"messages": [USER], "temperature": "hot"}, "temperature", "valid number (got 'hot')"),
        ({"messages": [USER], "max_tokens": 1.5}, "max_tokens", "valid integer"),
        ({"messages": [USER], "n": True}, "n", "valid integer"),
        ({"messages": [USER], "top_p": 0}, "top_p", "greater than 0"),
        ({"messages": [USER], "seed": 2**64}, "seed", "less than"),
        ({"messages": [USER], "stop": 3}, "stop", "valid string, or: Input should be a valid array (got 3)"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "valid string"),
        (
            {"messages": [USER], "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "bool",
        ),
        ({}, "messages", "Field required"),
    ],
)
def test_validation_errors_name_the_field_and_what_it_should_be(fields, param, message):
    described, named = problem(ChatCompletionRequest, **fields)
    assert named == param
    assert described.startswith(f"{param}: ")
    assert message in described


def test_a_body_that_is_not_json_or_not_an_object_says_so():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(b"{oops")
    assert describe_validation_error(caught.value)[0].startswith("the request body is not valid JSON")
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(b'"text"')
    assert describe_validation_error(caught.value) == (
        "the request body must be a JSON object: Input should be an object",
        None,
    )


def test_error_body_has_openais_shape():
    assert error_body("bad", "invalid_request_error", "top_p", 400) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": 400}
    }


def test_a_delta_holds_only_what_it_sets():
    assert Delta().model_dump() == {}
    assert Delta(content="x").model_dump() == {"content": "x"}
    assert Delta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


def test_every_stop_reason_has_a_finish_reason():
    assert FINISH_REASONS == {
        "eos": "stop",
        "stop_string": "stop",
        "max_new_tokens": "length",
        "context_length": "length",
    }
