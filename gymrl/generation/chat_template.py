"""Render OpenAI chat messages (and tools) to ChatML token ids; parse tool calls out of generations.

The policy server is token-in / token-out towards its engine, so this module decides the
exact prompt tokens of every model call. Two rules matter for training:

* The rendering is ChatML as SmolLM2's own template writes it (`<|im_start|>{role}\\n{content}
  <|im_end|>\\n`, SmolLM2's default system prompt when the first message is not a system message,
  generation prompt `<|im_start|>assistant\\n`), extended with Hermes/Qwen-style tools: their JSON
  schemas go into the system message and the model answers a call as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
* The on-policy prefix fix (:func:`build_prompt_token_ids`): when a client sends back the token
  ids of an earlier assistant turn, the prompt reuses those exact ids and renders only the
  messages after that turn. Re-rendering and re-tokenising the history instead (BPE merges a
  boundary differently, tool-call JSON re-serialised with other whitespace) gives a prompt that
  does not start with what the sampler saw, and the episode stops being contiguous.

The message types are the wire vocabulary of `nemo_gym_ext.wire`, shared with the Gym agents.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from gymrl.model.tokens import decode_text
from nemo_gym_ext.wire import ChatMessage, FunctionCall, ToolCall, ToolSpec

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
SMOLLM2_DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)

# The body may not contain another opening tag, so an unclosed block cannot swallow the next one.
_TOOL_CALL_PATTERN = re.compile(
    re.escape(TOOL_CALL_OPEN)
    + r"((?:(?!"
    + re.escape(TOOL_CALL_OPEN)
    + r").)*?)"
    + re.escape(TOOL_CALL_CLOSE),
    re.DOTALL,
)


class ChatFormatError(ValueError):
    """A request the chat format cannot render; `param` names the offending field."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PromptTokens:
    """The prompt of one model call and how much of it was taken verbatim from the client.

    `reused_from_message` is the index of the assistant message whose `prompt_token_ids +
    generation_token_ids` start the prompt (None when the whole conversation was rendered from
    text); `reused_token_count` is the length of that verbatim prefix.
    """

    token_ids: list[int]
    reused_from_message: int | None
    reused_token_count: int


@dataclass(frozen=True)
class ParsedGeneration:
    """An assistant answer split into free text (None when empty) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ChatMLFormat:
    """ChatML rendering and tokenisation with one tokenizer.

    Not thread-safe (Hugging Face fast tokenizers may fail when used from several threads at
    once); the policy server calls it from a single worker thread.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        default_system_prompt: str | None = SMOLLM2_DEFAULT_SYSTEM_PROMPT,
    ):
        self.tokenizer = tokenizer
        self.default_system_prompt = default_system_prompt
        self.vocab_size = len(tokenizer)
        self.end_of_turn_id = self._special_token_id(IM_END)
        self._special_token_id(IM_START)  # checked only: every rendered turn starts with it

    def _special_token_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"the tokenizer encodes {token!r} as {ids}, not one special token: it is not a "
                "ChatML tokenizer; use a tokenizer with <|im_start|>/<|im_end|> special tokens"
            )
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens (the closing `<|im_end|>`) dropped."""
        return decode_text(self.tokenizer, token_ids, skip_special_tokens=True)

    def render_conversation(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None
    ) -> str:
        """The whole conversation as ChatML text, ending with the generation prompt."""
        parts = []
        first_is_system = bool(messages) and messages[0].role == "system"
        if first_is_system:
            parts.append(_turn("system", _with_tools(messages[0].text, tools)))
        elif self.default_system_prompt is not None or tools:
            parts.append(_turn("system", _with_tools(self.default_system_prompt, tools)))
        start = 1 if first_is_system else 0
        parts.extend(self.render_messages(messages[start:], first_index=start))
        parts.append(GENERATION_PROMPT)
        return "".join(parts)

    def render_messages(self, messages: Sequence[ChatMessage], *, first_index: int) -> list[str]:
        """Each message as one ChatML turn; `first_index` numbers them in error messages."""
        return [
            _turn(message.role, _message_body(message, index))
            for index, message in enumerate(messages, start=first_index)
        ]

    def check_token_ids(self, token_ids: Sequence[int], *, param: str) -> None:
        """Raise :class:`ChatFormatError` naming `param` if an id lies outside the vocabulary."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return
        position, value = next(
            (i, t) for i, t in enumerate(token_ids) if not 0 <= t < self.vocab_size
        )
        raise ChatFormatError(
            f"{param}[{position}] = {value} is not a token id of this model (vocabulary size "
            f"{self.vocab_size}); send back the ids exactly as the server returned them",
            param=param,
        )


def build_prompt_token_ids(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] | None,
    chat_format: ChatMLFormat,
    *,
    honor_prompt_token_ids: bool,
) -> PromptTokens:
    """The prompt token ids of a chat request, honouring earlier token ids when asked to.

    With `honor_prompt_token_ids` and an assistant message carrying `prompt_token_ids` and
    `generation_token_ids`, the prompt is the LAST such message's `prompt_token_ids +
    generation_token_ids` verbatim, then `<|im_end|>` if that generation did not end with it, the
    turn separator, the ChatML rendering of only the later messages, and the generation prompt.
    Everything up to that message is already inside its prompt ids, tools included, so it is not
    rendered again. Otherwise the whole conversation is rendered from text and tokenised.

    Only the ids that enter the prompt are range-checked; a bad one raises
    :class:`ChatFormatError` naming the message index and field.
    """
    anchor = _last_index_with_token_ids(messages) if honor_prompt_token_ids else None
    if anchor is None:
        ids = chat_format.encode(chat_format.render_conversation(messages, tools))
        return PromptTokens(token_ids=ids, reused_from_message=None, reused_token_count=0)
    message = messages[anchor]
    # ChatMessage sends both id lists or neither, and the anchor carries them.
    prompt_ids, generation_ids = message.prompt_token_ids, message.generation_token_ids or []
    if not prompt_ids:
        raise ChatFormatError(
            f"messages[{anchor}].prompt_token_ids is empty; send back the prompt ids the server "
            "returned for that turn, or leave out all three token fields",
            param=f"messages[{anchor}].prompt_token_ids",
        )
    chat_format.check_token_ids(prompt_ids, param=f"messages[{anchor}].prompt_token_ids")
    chat_format.check_token_ids(generation_ids, param=f"messages[{anchor}].generation_token_ids")
    prefix = [*prompt_ids, *generation_ids]
    closed = bool(generation_ids) and generation_ids[-1] == chat_format.end_of_turn_id
    suffix = "".join(
        [
            "" if closed else IM_END,
            "\n",
            *chat_format.render_messages(messages[anchor + 1 :], first_index=anchor + 1),
            GENERATION_PROMPT,
        ]
    )
    return PromptTokens(
        token_ids=prefix + chat_format.encode(suffix),
        reused_from_message=anchor,
        reused_token_count=len(prefix),
    )


def parse_generation(text: str) -> ParsedGeneration:
    """Split generated text into tool calls and the free text around them.

    Every well-formed `<tool_call>{"name": str, "arguments": {...}}</tool_call>` becomes a tool
    call with a fresh id and its arguments re-serialised as a JSON string. A block whose JSON is
    malformed stays in the text, so a model's mistake reaches the agent as content instead of
    failing the request. With no tool call the text is returned unchanged.
    """
    tool_calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for match in _TOOL_CALL_PATTERN.finditer(text):
        call = _parse_tool_call(match.group(1))
        if call is None:
            continue
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        tool_calls.append(call)
    if not tool_calls:
        return ParsedGeneration(content=text or None, tool_calls=[])
    kept.append(text[cursor:])
    content = "".join(kept).strip()
    return ParsedGeneration(content=content or None, tool_calls=tool_calls)


def _parse_tool_call(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    if not payload["name"] or not isinstance(arguments, dict):
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=FunctionCall(
            name=payload["name"], arguments=json.dumps(arguments, ensure_ascii=False)
        ),
    )


def _last_index_with_token_ids(messages: Sequence[ChatMessage]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "assistant" and messages[index].carries_token_ids:
            return index
    return None


def _turn(role: str, body: str) -> str:
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def _with_tools(system_prompt: str | None, tools: Sequence[ToolSpec] | None) -> str:
    if not tools:
        return system_prompt or ""
    schemas = "\n".join(
        json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in tools
    )
    block = (
        "# Tools\n\n"
        "You may call one or more of the functions below to help with the request. Their "
        "signatures are JSON schemas inside <tools></tools>:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "To call a function, answer with one <tool_call></tool_call> block per call, each "
        "holding a JSON object with the function's name and its arguments:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{TOOL_CALL_CLOSE}"
    )
    return f"{system_prompt}\n\n{block}" if system_prompt else block


def _message_body(message: ChatMessage, index: int) -> str:
    if message.role != "assistant" or not message.tool_calls:
        return message.text
    blocks = [message.text] if message.text else []
    for position, call in enumerate(message.tool_calls):
        param = f"messages[{index}].tool_calls[{position}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as error:
            raise ChatFormatError(
                f"{param} is not valid JSON ({error.msg} at position {error.pos}): "
                f"{call.function.arguments[:80]!r}; send the arguments as a JSON object string",
                param=param,
            ) from error
        payload = json.dumps(
            {"name": call.function.name, "arguments": arguments}, ensure_ascii=False
        )
        blocks.append(f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}")
    return "\n".join(blocks)
