"""SmolLM2's rendering (its template with tools), Hermes tool calls and the on-policy prefix fix.

The prompts of the default run: these expected strings are what the recipe rendered before prompts
came from chat templates, and stay byte for byte the same.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymrl.generation.server.chat_template import ChatFormatError, build_prompt_token_ids
from gymrl.generation.server.parsers import GenerationParser
from nemo_gym_ext.wire import ChatMessage, FunctionSpec, ToolSpec

HERMES = GenerationParser("hermes")

ADD_TOOL = ToolSpec(
    function=FunctionSpec(
        name="add",
        description="Add two integers.",
        parameters={"type": "object", "properties": {"a": {"type": "integer"}}},
    )
)


def messages(*dicts):
    return [ChatMessage.model_validate(d) for d in dicts]


def char_level_ids(tokenizer, text: str) -> list[int]:
    """A valid but non-canonical tokenisation of `text`: one byte-level token per character."""
    pieces = tokenizer.convert_tokens_to_ids([("Ġ" if c == " " else c) for c in text])
    assert tokenizer.decode(pieces) == text
    assert pieces != tokenizer.encode(text, add_special_tokens=False)
    return pieces


@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Add 2 and 3."},
        ],
    ],
)
def test_plain_conversation_matches_smollm2_template(tokenizer, chat_format, conversation):
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert chat_format.render(messages(*conversation), None) == expected


def test_tools_go_into_the_system_message(chat_format):
    with_system = chat_format.render(
        messages({"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}),
        [ADD_TOOL],
    )
    schema = json.dumps(ADD_TOOL.model_dump(exclude_none=True))
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    system_turn = with_system.split("<|im_end|>")[0]
    assert f"<tools>\n{schema}\n</tools>" in system_turn
    assert "<tool_call>" in system_turn
    assert with_system.count("<|im_start|>system") == 1

    without_system = chat_format.render(messages({"role": "user", "content": "q"}), [ADD_TOOL])
    assert without_system.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "\n\n# Tools\n"
    )


def test_developer_assistant_tool_calls_and_tool_roles(chat_format):
    rendered = chat_format.render(
        messages(
            {"role": "system", "content": "S"},
            {"role": "developer", "content": "Use tools."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                    }
                ],
            },
            {"role": "tool", "content": "5", "tool_call_id": "call_1"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [{"id": "call_2", "function": {"name": "add", "arguments": "{}"}}],
            },
        ),
        None,
    )
    assert rendered == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>developer\nUse tools.<|im_end|>\n"
        "<|im_start|>user\n2+3<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n5<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "add", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_unparseable_arguments_on_an_earlier_tool_call_name_the_field(chat_format):
    conversation = messages(
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
        },
    )
    with pytest.raises(ChatFormatError) as raised:
        chat_format.render(conversation, None)
    assert raised.value.param == "messages[1].tool_calls[0].function.arguments"
    assert "{oops" in str(raised.value)


def test_parse_tool_calls_into_json_string_arguments():
    parsed = HERMES.parse(
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": "é"}}\n</tool_call>\n'
        '<tool_call>{"name": "noop"}</tool_call>'
    )
    assert parsed.content is None
    assert [call.function.name for call in parsed.tool_calls] == ["add", "noop"]
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"a": 2, "b": "é"}
    assert parsed.tool_calls[1].function.arguments == "{}"
    ids = [call.id for call in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_parse_keeps_text_and_malformed_blocks_as_content():
    parsed = HERMES.parse(
        'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        "<tool_call>{not json}</tool_call>"
    )
    assert [call.function.name for call in parsed.tool_calls] == ["add"]
    assert parsed.content == "Let me add.\n\n<tool_call>{not json}</tool_call>"

    only_bad = HERMES.parse('<tool_call>{"name": 3}</tool_call> and <tool_call>[1]</tool_call>')
    assert only_bad.tool_calls == []
    assert only_bad.content == '<tool_call>{"name": 3}</tool_call> and <tool_call>[1]</tool_call>'

    assert HERMES.parse("  plain answer \n").content == "  plain answer \n"
    assert HERMES.parse("").content is None


def test_unclosed_block_does_not_swallow_a_later_call():
    parsed = HERMES.parse(
        '<tool_call>{"name": <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    assert [call.function.name for call in parsed.tool_calls] == ["f"]
    assert parsed.content == '<tool_call>{"name":'


json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_rendered_tool_call_parses_back_to_the_same_call(chat_format, arguments):
    assistant = ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[{"id": "c", "function": {"name": "f", "arguments": json.dumps(arguments)}}],
    )
    rendered = chat_format.render([assistant], None, add_generation_prompt=False)
    body = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    parsed = HERMES.parse(body)
    assert parsed.content is None
    assert [call.function.name for call in parsed.tool_calls] == ["f"]
    assert json.loads(parsed.tool_calls[0].function.arguments) == arguments


def two_turn_conversation(tokenizer, chat_format, *, close_turn: bool):
    """Turn one's real prompt plus a char-level generation, then a user follow-up."""
    first = messages({"role": "user", "content": "Say hello world."})
    first_prompt = chat_format.encode(chat_format.render(first, None))
    generation = char_level_ids(tokenizer, "hello world") + (
        [chat_format.end_of_turn_id] if close_turn else []
    )
    conversation = messages(
        {"role": "user", "content": "Say hello world."},
        {
            "role": "assistant",
            "content": "hello world",
            "prompt_token_ids": first_prompt,
            "generation_token_ids": generation,
            "generation_log_probs": [-0.5] * len(generation),
        },
        {"role": "user", "content": "Again."},
    )
    return conversation, first_prompt + generation


@pytest.mark.parametrize("close_turn", [True, False])
def test_honoured_prefix_keeps_noncanonical_ids_exactly(tokenizer, chat_format, close_turn):
    conversation, earlier = two_turn_conversation(tokenizer, chat_format, close_turn=close_turn)
    prompt = build_prompt_token_ids(conversation, None, chat_format, honor_prompt_token_ids=True)
    assert prompt.reused_from_message == 1
    assert prompt.reused_token_count == len(earlier)
    closing = "" if close_turn else "<|im_end|>"
    tail = chat_format.encode(
        f"{closing}\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.token_ids == earlier + tail
    # Same text, so the re-rendered prompt decodes alike; only the token ids differ.
    rerendered = chat_format.encode(chat_format.render(conversation, None))
    assert tokenizer.decode(prompt.token_ids) == tokenizer.decode(rerendered)
    assert prompt.token_ids != rerendered


def test_without_honouring_the_conversation_is_retokenised(tokenizer, chat_format):
    conversation, earlier = two_turn_conversation(tokenizer, chat_format, close_turn=True)
    prompt = build_prompt_token_ids(conversation, None, chat_format, honor_prompt_token_ids=False)
    assert prompt.reused_from_message is None and prompt.reused_token_count == 0
    reference = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text} for m in conversation], add_generation_prompt=True
    )
    assert prompt.token_ids == reference["input_ids"]
    assert prompt.token_ids[: len(earlier)] != earlier


def test_the_last_assistant_with_ids_anchors_and_later_messages_render(tokenizer, chat_format):
    conversation, _ = two_turn_conversation(tokenizer, chat_format, close_turn=True)
    second_prompt = build_prompt_token_ids(
        conversation, None, chat_format, honor_prompt_token_ids=True
    )
    second_generation = [*chat_format.encode("Hi."), chat_format.end_of_turn_id]
    longer = [
        *conversation,
        ChatMessage(
            role="assistant",
            content="Hi.",
            prompt_token_ids=second_prompt.token_ids,
            generation_token_ids=second_generation,
        ),
        ChatMessage(role="user", content="Bye."),
        ChatMessage(role="assistant", content="Rendered from text."),
    ]
    prompt = build_prompt_token_ids(longer, None, chat_format, honor_prompt_token_ids=True)
    assert prompt.reused_from_message == 3
    tail = chat_format.encode(
        "\n<|im_start|>user\nBye.<|im_end|>\n<|im_start|>assistant\nRendered from text.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.token_ids == second_prompt.token_ids + second_generation + tail


def test_no_ids_to_honour_renders_everything(chat_format):
    conversation = messages({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    honoured = build_prompt_token_ids(
        conversation, [ADD_TOOL], chat_format, honor_prompt_token_ids=True
    )
    assert honoured.reused_from_message is None
    assert honoured.token_ids == chat_format.encode(chat_format.render(conversation, [ADD_TOOL]))


@pytest.mark.parametrize(
    ("field", "ids", "fragment"),
    [
        ("generation_token_ids", [5, 49152], "messages[1].generation_token_ids[1] = 49152"),
        ("prompt_token_ids", [-1, 5], "messages[1].prompt_token_ids[0] = -1"),
        ("prompt_token_ids", [], "messages[1].prompt_token_ids is empty"),
    ],
)
def test_out_of_vocabulary_ids_name_message_and_field(chat_format, field, ids, fragment):
    assistant = {
        "role": "assistant",
        "content": "a",
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
    }
    assistant[field] = ids
    conversation = messages(
        {"role": "user", "content": "q"}, assistant, {"role": "user", "content": "r"}
    )
    with pytest.raises(ChatFormatError) as raised:
        build_prompt_token_ids(conversation, None, chat_format, honor_prompt_token_ids=True)
    assert raised.value.param == f"messages[1].{field}"
    assert fragment in str(raised.value)
