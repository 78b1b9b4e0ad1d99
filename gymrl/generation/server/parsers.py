"""Split a model's generated text into reasoning, answer text and tool calls, per model family.

Model families write tool calls and reasoning differently, and the policy server must read them
the way the model was trained to write them, so the parsers are chosen by config
(`policy.tool_call_parser`, `policy.reasoning_parser`) from the registries below; an unknown name
is refused when the config is validated, with the list of these names.

A model's mistake never fails the request: a tool call that does not parse stays in the answer
text, so the agent sees what the model wrote and the episode goes on (and is rewarded as such).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_gym_ext.wire import FunctionCall, ToolCall


@dataclass(frozen=True)
class ParsedGeneration:
    """An assistant answer: free text (None when empty), reasoning (None when none) and calls."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = None


@dataclass(frozen=True)
class _Split:
    text: str
    tool_calls: list[ToolCall]


def _tool_call(name: Any, arguments: Any) -> ToolCall | None:
    """An OpenAI tool call with a fresh id, or None when the name or arguments are unusable."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)),
    )


# ------------------------------------------------------------------------------ tool-call parsers
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
# The body may not contain another opening tag, so an unclosed block cannot swallow the next one.
_HERMES_BLOCK = re.compile(
    re.escape(_HERMES_OPEN)
    + r"((?:(?!"
    + re.escape(_HERMES_OPEN)
    + r").)*?)"
    + re.escape(_HERMES_CLOSE),
    re.DOTALL,
)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    return _tool_call(payload.get("name"), payload.get("arguments", {}))


def parse_hermes_tool_calls(text: str) -> _Split:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
    anywhere in the answer. A block whose JSON does not parse stays in the text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        calls.append(call)
    if not calls:
        return _Split(text, [])
    kept.append(text[cursor:])
    return _Split("".join(kept).strip(), calls)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json_tool_calls(text: str) -> _Split:
    """Llama 3.1-3.3: the whole answer is one JSON object `{"name": ..., "parameters": {...}}`
    (`arguments` is accepted too), or several separated by `;`, optionally after
    `<|python_tag|>`. Anything else is a plain-text answer."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return _Split(text, [])
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while position < len(body):
        try:
            payload, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return _Split(text, [])
        if not isinstance(payload, dict):
            return _Split(text, [])
        arguments = payload.get("parameters", payload.get("arguments", {}))
        call = _tool_call(payload.get("name"), arguments)
        if call is None:
            return _Split(text, [])
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return _Split("", calls)


TOOL_CALL_PARSERS: Mapping[str, Callable[[str], _Split]] = {
    "hermes": parse_hermes_tool_calls,
    "llama3_json": parse_llama3_json_tool_calls,
}


# ------------------------------------------------------------------------------ reasoning parsers
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def parse_think_block(text: str) -> tuple[str | None, str]:
    """Qwen3 (and DeepSeek-R1 style): reasoning is what precedes `</think>`, after an optional
    `<think>` (the opening tag may sit in the prompt instead). Without `</think>` there is no
    reasoning and the text is the answer, unchanged (a truncated think block reaches the agent
    as text rather than vanishing)."""
    head, closed, tail = text.partition(_THINK_CLOSE)
    if not closed:
        return None, text
    reasoning = head.strip().removeprefix(_THINK_OPEN).strip()
    return reasoning or None, tail.lstrip("\n")


REASONING_PARSERS: Mapping[str, Callable[[str], tuple[str | None, str]]] = {
    "qwen3": parse_think_block,
}


def unknown_parser_message(kind: str, name: str, known: Mapping[str, object]) -> str | None:
    """The refusal of a configured parser name this recipe does not have, or None when known."""
    if name in known:
        return None
    return f"unknown {kind} parser {name!r}; this recipe has: {', '.join(sorted(known))}"


@dataclass(frozen=True)
class GenerationParser:
    """The reasoning parser (optional) and the tool-call parser of one model family, by name."""

    tool_call_parser: str
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        problems = [
            unknown_parser_message("tool-call", self.tool_call_parser, TOOL_CALL_PARSERS),
            None
            if self.reasoning_parser is None
            else unknown_parser_message("reasoning", self.reasoning_parser, REASONING_PARSERS),
        ]
        if any(problems):
            raise ValueError("; ".join(p for p in problems if p))

    def parse(self, text: str) -> ParsedGeneration:
        """Reasoning first (it precedes the answer), then tool calls in the rest."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = REASONING_PARSERS[self.reasoning_parser](text)
        split = TOOL_CALL_PARSERS[self.tool_call_parser](text)
        return ParsedGeneration(
            content=split.text or None, tool_calls=split.tool_calls, reasoning_content=reasoning
        )
