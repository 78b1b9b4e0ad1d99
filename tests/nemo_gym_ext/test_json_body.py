"""`nemo_gym_ext.json_body`: one pydantic-core pass, and refusals that still name the field."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from nemo_gym_ext.http_server import describe_validation_errors
from nemo_gym_ext.json_body import lone_surrogate_at, parse_json_body
from nemo_gym_ext.wire import ChatCompletionRequest

USER = {"role": "user", "content": "hi"}


def refusal(raw: bytes) -> str:
    with pytest.raises(RequestValidationError) as caught:
        parse_json_body(raw, ChatCompletionRequest)
    return describe_validation_errors(caught.value.errors())


def test_a_valid_body_is_parsed_with_its_token_ids():
    assistant = {
        "role": "assistant",
        "content": "x",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }
    body = {"messages": [USER, assistant, USER], "seed": 3}
    request = parse_json_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.messages[1].prompt_token_ids == [1, 2]
    assert request.seed == 3


@pytest.mark.parametrize(
    ("raw", "location"),
    [
        (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
        (b'{"model": "\\udfff", "messages": [{"role": "user", "content": "a"}]}', "model"),
        (b'{"messages": [{"role": "user", "content": "a"}], "x\\ud800": 1}', "x\\ud800"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_its_field(raw, location):
    message = refusal(raw)
    assert "lone UTF-16 surrogate" in message
    assert message.startswith(f"invalid request: {location}: ")
    message.encode("utf-8")  # the answer is text, even when a key holds the surrogate


def test_a_surrogate_pair_is_text():
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert parse_json_body(raw, ChatCompletionRequest).messages[0].content == "\U0001f600"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "EOF while parsing"),
        (b"\xff\xfe not utf-8", "expected value"),
        (b"[" * 100_000 + b"]" * 100_000, "recursion limit"),
        (b'{"messages": [', "EOF while parsing"),
    ],
)
def test_a_body_that_is_not_json_is_refused_with_the_parsers_words(raw, words):
    message = refusal(raw)
    assert message.startswith("invalid request: body: Invalid JSON")
    assert words in message


def test_validation_errors_keep_their_field_locations():
    raw = json.dumps({"messages": [USER, {"role": "tool", "content": "5"}], "top_p": 0}).encode()
    message = refusal(raw)
    assert "messages.1: Value error, a 'tool' message needs `tool_call_id`" in message
    assert "top_p: Input should be greater than 0" in message


def test_lone_surrogate_at_walks_keys_and_values_without_recursion():
    deep: list = ["fine"]
    for _ in range(5000):
        deep = [deep]
    assert lone_surrogate_at({"a": [deep, {"b": "x\udc00"}]}) == ("a", 1, "b")
    assert lone_surrogate_at({"k\ud800": 1}) == ("k\ud800",)
    assert lone_surrogate_at({"a": deep}) is None
