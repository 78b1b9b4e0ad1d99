"""Tool-call and reasoning parsers on model-shaped outputs, malformed ones included."""

from __future__ import annotations

import json

import pytest

from gymrl.generation.server.parsers import GenerationParser

QWEN3 = GenerationParser("hermes", "qwen3")
LLAMA3 = GenerationParser("llama3_json")


def calls(parsed):
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]


def test_qwen3_thinking_then_answer():
    parsed = QWEN3.parse("<think>\n2 + 3 is 5.\n</think>\n\nThe answer is 5.")
    assert parsed.reasoning_content == "2 + 3 is 5."
    assert parsed.content == "The answer is 5." and parsed.tool_calls == []


def test_qwen3_thinking_then_tool_calls():
    parsed = QWEN3.parse(
        "<think>\nI need the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call>'
    )
    assert parsed.reasoning_content == "I need the tool."
    assert parsed.content is None
    assert calls(parsed) == [("add", {"a": 2, "b": 3}), ("add", {"a": 5, "b": 1})]


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        # Non-thinking mode: the empty block came with the prompt, the answer is plain.
        ("The answer is 5.", None, "The answer is 5."),
        # The opening tag sat in the prompt (thinking-only models): reasoning up to </think>.
        ("2 + 3 is 5.\n</think>\n\n5", "2 + 3 is 5.", "5"),
        # An empty think block is no reasoning.
        ("<think>\n\n</think>\n\nHi", None, "Hi"),
        # Cut off while thinking (max_tokens): nothing is lost, the text is the answer.
        ("<think>\nStill think", None, "<think>\nStill think"),
        # Only reasoning, no answer.
        ("<think>\nHmm.\n</think>", "Hmm.", None),
    ],
)
def test_qwen3_reasoning_shapes(text, reasoning, content):
    parsed = QWEN3.parse(text)
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == (
        reasoning,
        content,
        [],
    )


def test_qwen3_malformed_tool_call_after_reasoning_stays_text():
    parsed = QWEN3.parse(
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "add", "argu\n</tool_call>'
    )
    assert parsed.reasoning_content == "ok"
    assert parsed.tool_calls == []
    assert parsed.content == '<tool_call>\n{"name": "add", "argu\n</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
        '  {"name": "add", "arguments": {"a": 2, "b": 3}}\n',
    ],
)
def test_llama3_json_tool_call(text):
    parsed = LLAMA3.parse(text)
    assert parsed.content is None and calls(parsed) == [("add", {"a": 2, "b": 3})]


def test_llama3_json_several_calls():
    parsed = LLAMA3.parse(
        '{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {"x": 2}}'
    )
    assert calls(parsed) == [("add", {"a": 1}), ("neg", {"x": 2})]


@pytest.mark.parametrize(
    "text",
    [
        "The sum is 5.",
        '{"name": "add", "parameters": {"a": 2',  # cut off
        '{"answer": 5}',  # JSON, not a call
        '{"name": "add", "parameters": [2, 3]}',  # arguments not an object
        '{"name": "add", "parameters": {}} and then prose',
        '{"name": "", "parameters": {}}',
        "[1, 2]",
    ],
)
def test_llama3_json_anything_else_is_a_plain_text_answer(text):
    parsed = LLAMA3.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_unknown_parser_names_list_what_the_recipe_has():
    with pytest.raises(ValueError, match=r"tool-call parser 'pythonic'.*hermes, llama3_json"):
        GenerationParser("pythonic")
    with pytest.raises(ValueError, match=r"reasoning parser 'r1'.*qwen3"):
        GenerationParser("hermes", "r1")
