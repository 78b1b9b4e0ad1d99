import pytest
from pydantic import ValidationError

from nemo_gym_ext.wire import (
    TOKEN_FIELDS,
    ChatCompletion,
    ChatMessage,
    Row,
    assistant_message_item,
    chat_tools,
    completion_to_items,
    final_assistant_text,
    function_call_item,
    function_call_output_item,
    items_to_chat_messages,
    user_message_item,
)


def bundle(prompt: list[int], generation: list[int], logprobs: list[float]) -> dict:
    return dict(zip(TOKEN_FIELDS, (prompt, generation, logprobs), strict=True))


BUNDLE_1 = bundle([1, 2], [3, 4], [-0.1, -0.2])
BUNDLE_2 = bundle([1, 2, 3, 4, 5], [6], [-0.3])


def completion(message: dict, finish_reason: str = "stop") -> ChatCompletion:
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "policy",
            "choices": [{"index": 0, "finish_reason": finish_reason, "message": message}],
        }
    )


def episode() -> list[dict]:
    """Prompt, a text + tool-call turn, its tool output, a tool-call-only turn, a user follow-up."""
    return [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "What is 2 + 3?"},
        assistant_message_item("Let me compute."),
        function_call_item("call_a", "calculator", '{"expression": "2+3"}') | BUNDLE_1,
        function_call_output_item("call_a", "5"),
        function_call_item("call_b", "calculator", '{"expression": "5"}') | BUNDLE_2,
        function_call_output_item("call_b", "5"),
        user_message_item("And the answer?"),
    ]


def test_items_become_chat_messages_with_token_ids_on_earlier_assistant_turns():
    messages = items_to_chat_messages(episode(), include_token_ids=True)
    assert [m["role"] for m in messages] == [
        "developer", "user", "assistant", "tool", "assistant", "tool", "user",
    ]  # fmt: skip
    first, second = messages[2], messages[4]
    assert first["content"] == "Let me compute."
    assert first["tool_calls"] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
        }
    ]
    assert {name: first[name] for name in TOKEN_FIELDS} == BUNDLE_1
    assert second["content"] is None, "a tool-call-only turn has content null"
    assert {name: second[name] for name in TOKEN_FIELDS} == BUNDLE_2
    assert messages[3] == {"role": "tool", "tool_call_id": "call_a", "content": "5"}
    assert messages[6] == {"role": "user", "content": "And the answer?"}


def test_items_become_text_only_messages_without_token_ids():
    messages = items_to_chat_messages(episode(), include_token_ids=False)
    for message in messages:
        assert not set(TOKEN_FIELDS) & set(message)
    assert messages[4]["content"] is None


def test_each_token_bundle_closes_its_own_assistant_message():
    items = [
        {"role": "user", "content": "hi"},
        assistant_message_item("one") | BUNDLE_1,
        assistant_message_item("two") | BUNDLE_2,
    ]
    messages = items_to_chat_messages(items, include_token_ids=True)
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "hi"),
        ("assistant", "one"),
        ("assistant", "two"),
    ]


def test_unknown_items_are_rejected_with_their_position():
    with pytest.raises(ValueError, match="item 1 has type 'reasoning'"):
        items_to_chat_messages(
            [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}],
            include_token_ids=True,
        )


def test_completion_puts_the_token_bundle_on_the_last_item_only():
    tool_call = {"id": "call_1", "function": {"name": "guess", "arguments": '{"number": 4}'}}
    calls = [tool_call, tool_call | {"id": "call_2"}]
    message = {"role": "assistant", "content": "I guess", "tool_calls": calls} | BUNDLE_1
    items, finish_reason = completion_to_items(completion(message, finish_reason="tool_calls"))
    assert finish_reason == "tool_calls"
    assert [item["type"] for item in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "I guess"
    assert [item["call_id"] for item in items[1:]] == ["call_1", "call_2"]
    assert {name: items[-1][name] for name in TOKEN_FIELDS} == BUNDLE_1
    for item in items[:-1]:
        assert not set(TOKEN_FIELDS) & set(item)


def test_a_completion_without_text_or_tool_calls_still_carries_its_tokens():
    items, _ = completion_to_items(completion({"role": "assistant", "content": None} | BUNDLE_2))
    assert len(items) == 1
    assert items[0]["type"] == "message"
    assert items[0]["generation_token_ids"] == BUNDLE_2["generation_token_ids"]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "assistant", "prompt_token_ids": [1], "generation_token_ids": [2]},
         "token bundle is incomplete"),
        ({"role": "assistant"} | BUNDLE_1 | {"generation_log_probs": [-1.0]}, "has 1 entries"),
        ({"role": "user", "content": "x"}, "assistant"),
    ],
)  # fmt: skip
def test_malformed_completions_are_rejected(message, error):
    with pytest.raises(ValidationError, match=error):
        completion(message)


def test_a_completion_needs_the_openai_required_fields():
    with pytest.raises(ValidationError, match="created"):
        ChatCompletion.model_validate(
            {"id": "c", "object": "chat.completion", "model": "m", "choices": []}
        )


def test_tools_are_converted_to_chat_format():
    flat = {
        "type": "function",
        "name": "guess",
        "description": "d",
        "parameters": {},
        "strict": True,
    }
    nested = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    assert chat_tools([flat, nested]) == [
        {"type": "function", "function": {"name": "guess", "description": "d", "parameters": {}}},
        nested,
    ]
    with pytest.raises(ValueError, match=r"tools\[0\] has type 'web_search'"):
        chat_tools([{"type": "web_search"}])


def test_a_string_input_is_one_user_message():
    row = Row.model_validate(
        {
            "responses_create_params": {"input": "hello"},
            "agent_ref": {"type": "responses_api_agents", "name": "a"},
            "task_field": 3,
        }
    )
    assert row.responses_create_params.input == [{"role": "user", "content": "hello"}]
    assert row.model_extra == {"task_field": 3}


def test_final_assistant_text_is_the_text_after_the_last_tool_output():
    items = episode()
    assert final_assistant_text(items) == ""
    items.append(assistant_message_item("It is 5.") | BUNDLE_2)
    assert final_assistant_text(items) == "It is 5."
    assert final_assistant_text(items[:6]) == ""


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"role": "tool", "content": "5"}, "tool_call_id"),
        ({"role": "user", "content": None}, "needs `content`"),
        (
            {"role": "user", "content": "q", "prompt_token_ids": [1], "generation_token_ids": [2]},
            "assistant",
        ),
        ({"role": "assistant", "content": "a", "prompt_token_ids": [1]}, "together"),
        (
            {
                "role": "assistant",
                "content": "a",
                "prompt_token_ids": [1],
                "generation_token_ids": [2, 3],
                "generation_log_probs": [-0.1],
            },
            "has 1 entries",
        ),
        (
            {
                "role": "assistant",
                "content": "a",
                "prompt_token_ids": [1, "2"],
                "generation_token_ids": [],
            },
            "integer",
        ),
    ],
)
def test_malformed_chat_messages_are_rejected(message, fragment):
    with pytest.raises(ValidationError, match=fragment):
        ChatMessage.model_validate(message)
