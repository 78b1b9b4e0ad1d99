"""The NeMo-Gym wire format, as this project speaks it: rows, output items, chat messages.

Two vocabularies meet here. A Gym *row* and its *result* use OpenAI Responses items (`message`,
`function_call`, `function_call_output`); the policy server speaks OpenAI Chat Completions. An
agent therefore converts in both directions on every model call, the way NeMo-Gym's `vllm_model`
adapter does in training mode:

* Responses items -> chat `messages` (:func:`items_to_chat_messages`): consecutive assistant
  items of one model call become one assistant message, closed by the item that carries the token
  bundle; a tool-call-only turn has `content: null`; earlier assistant turns carry their own
  `prompt_token_ids`, `generation_token_ids`, `generation_log_probs` so that the policy server can
  keep the exact tokens it sampled instead of re-tokenising text.
* a `ChatCompletion` -> output items (:func:`completion_to_items`): assistant text becomes a
  `message` item, each tool call a `function_call` item, and the token bundle goes on the *last*
  item of the call (design.md §1), where the postprocessor looks for it.

Only the fields these conversions need are modelled; everything else passes through (rows keep
their task fields, completions may carry vendor extras).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
AGENT_REF_TYPE = "responses_api_agents"
_ROLES = ("system", "developer", "user", "assistant")


class AgentRef(BaseModel):
    """Which agent serves a row: `{type: "responses_api_agents", name}`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["responses_api_agents"] = AGENT_REF_TYPE
    name: str = Field(min_length=1, description="Name of the agent that runs this row.")


class ResponsesCreateParams(BaseModel):
    """The part of a Responses `create` request that a row carries and the agent forwards."""

    model_config = ConfigDict(extra="allow")

    input: list[dict[str, Any]] = Field(
        min_length=1, description="Prompt items: messages with a role, as in the Responses API."
    )
    tools: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Function tools, Responses style ({type, name, description, parameters}) "
        "or Chat style ({type, function: {...}}).",
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_output_tokens: int | None = Field(
        default=None, ge=1, description="Per-call generation limit; sent as `max_tokens`."
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="Forwarded to the policy server only when set."
    )

    @field_validator("input", mode="before")
    @classmethod
    def _string_input_is_one_user_message(cls, value: Any) -> Any:
        """The Responses API accepts a bare string as input; it means one user message."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        return value


class Row(BaseModel):
    """One task for an agent. Task fields (anything else) are kept and echoed in the result."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesCreateParams
    agent_ref: AgentRef


class ChatFunction(BaseModel):
    """The function part of a chat tool call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str


class ChatToolCall(BaseModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ChatFunction


class ChatAssistantMessage(BaseModel):
    """`choices[0].message` of a completion, with the policy server's token bundle."""

    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None

    @model_validator(mode="after")
    def _bundle_is_complete(self) -> ChatAssistantMessage:
        present = [getattr(self, name) is not None for name in TOKEN_FIELDS]
        if any(present) and not all(present):
            missing = [name for name, there in zip(TOKEN_FIELDS, present, strict=True) if not there]
            raise ValueError(f"token bundle is incomplete: {missing} missing")
        if all(present) and len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"generation_token_ids has {len(self.generation_token_ids)} entries but "
                f"generation_log_probs has {len(self.generation_log_probs)}"
            )
        return self


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    finish_reason: str
    message: ChatAssistantMessage


class ChatCompletion(BaseModel):
    """A non-streaming OpenAI `ChatCompletion`; the fields design.md §4 makes required."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1)


def chat_tools(tools: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions tools `{type: "function", function: {name, description, parameters}}`.

    Rows follow the Responses API, whose function tools are flat; rows written for Chat
    Completions (already nested under `function`) pass through unchanged.
    """
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(
                f"tools[{index}] has type {tool.get('type')!r}; only function tools are supported"
            )
        if "function" in tool:
            converted.append(dict(tool))
            continue
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        if "name" not in function:
            raise ValueError(f"tools[{index}] has no `name`; a function tool needs one")
        converted.append({"type": "function", "function": function})
    return converted


def item_text(item: Mapping[str, Any]) -> str:
    """Text of a message item whose content is a string or a list of text parts."""
    content = item.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def assistant_message_item(text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def user_message_item(text: str) -> dict[str, Any]:
    """An environment's follow-up, in the shape of a Responses input message."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def function_call_output_item(call_id: str, output: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def completion_to_items(completion: ChatCompletion) -> tuple[list[dict[str, Any]], str]:
    """Output items of one model call and its `finish_reason`.

    Text (if any) comes first, then one `function_call` per tool call. A call that produced
    neither still yields an (empty) message item, so its tokens have somewhere to live. The token
    bundle goes on the last item.
    """
    choice = completion.choices[0]
    message = choice.message
    tool_calls = message.tool_calls or []
    items = []
    if message.content or not tool_calls:
        items.append(assistant_message_item(message.content or ""))
    items.extend(
        function_call_item(call.id, call.function.name, call.function.arguments)
        for call in tool_calls
    )
    if message.generation_token_ids is not None:
        items[-1].update({name: list(getattr(message, name)) for name in TOKEN_FIELDS})
    return items, choice.finish_reason


def items_to_chat_messages(
    items: Iterable[Mapping[str, Any]], *, include_token_ids: bool
) -> list[dict[str, Any]]:
    """Chat `messages` for the Responses `items` (prompt followed by the episode so far).

    Assistant `message` and `function_call` items accumulate into one assistant message until an
    item carrying the token bundle closes it (the last item of each model call) or a non-assistant
    item arrives. `include_token_ids=False` sends earlier turns as text and tool calls only, as an
    external harness would, so the server re-tokenises them.
    """
    messages: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            messages.append(pending)
            pending = None

    for index, item in enumerate(items):
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "function_call" or (kind == "message" and role == "assistant"):
            if pending is None:
                pending = {"role": "assistant", "content": None}
            if kind == "message":
                pending["content"] = (pending["content"] or "") + item_text(item)
            else:
                pending.setdefault("tool_calls", []).append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
            if "generation_token_ids" in item:
                if include_token_ids:
                    pending.update({name: item[name] for name in TOKEN_FIELDS})
                flush()
            continue
        flush()
        if kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        elif kind == "message" and role in _ROLES:
            messages.append({"role": role, "content": item_text(item)})
        else:
            raise ValueError(
                f"item {index} has type {kind!r} and role {role!r}; expected a message with role "
                f"in {_ROLES}, a function_call or a function_call_output"
            )
    flush()
    return messages


def final_assistant_text(items: list[Mapping[str, Any]]) -> str:
    """Assistant text produced after the episode's last tool output or user message.

    That is the model's final answer; an episode whose last model call only called tools (or
    that ended on a tool output) has none, and gets "".
    """
    texts = []
    for item in reversed(items):
        kind = item.get("type", "message")
        if kind == "function_call":
            continue
        if kind != "message" or item.get("role") != "assistant":
            break
        texts.append(item_text(item))
    return "".join(reversed(texts))
