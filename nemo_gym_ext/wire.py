"""The NeMo-Gym wire format, as this project speaks it: rows, output items, chat messages.

This is the one module that models the wire: the Gym agents (built-in or remote) and the policy
server in `gymrl.generation` both read and write these types, so a field is declared once.

Two vocabularies meet here. A Gym *row* and its *result* use OpenAI Responses items (`message`,
`function_call`, `function_call_output`); the policy server speaks OpenAI Chat Completions
(:class:`ChatCompletionRequest`, :class:`ChatMessage`, :class:`ChatCompletion`), with the token
bundle (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) on assistant messages.
An agent therefore converts in both directions on every model call, the way NeMo-Gym's
`vllm_model` adapter does in training mode:

* Responses items -> chat `messages` (:func:`items_to_chat_messages`): consecutive assistant
  items of one model call become one assistant message, closed by the item that carries the token
  bundle; a tool-call-only turn has `content: null`; earlier assistant turns carry their own
  `prompt_token_ids`, `generation_token_ids`, `generation_log_probs` so that the policy server can
  keep the exact tokens it sampled instead of re-tokenising text.
* a `ChatCompletion` -> output items (:func:`completion_to_items`): assistant text becomes a
  `message` item, each tool call a `function_call` item, and the token bundle goes on the *last*
  item of the call, where the postprocessor looks for it.

Only the fields these conversions and the policy server need are modelled; everything else passes
through (rows keep their task fields) or is ignored (vendor extras of a message).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# The largest log-probability taken for one: engines round log-softmax, so their own answers
# may hold tiny positive values; anything above is not a log-probability.
LOGPROB_TOLERANCE = 1e-4
# OpenAI's range of sampling temperatures is [0, 2].
MAX_TEMPERATURE = 2.0
# OpenAI's finish reason for output the server withheld; the policy server answers a diverged
# request with it under `generation.server.stop_on_divergence`, and clients end the episode.
WITHHELD_FINISH_REASON = "content_filter"
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


def agent_name_of(source: Mapping[str, Any]) -> str:
    """`agent_ref.name` of a row or a result: the one reader of that field.

    Rows are routed by it and results are attributed by it (metrics, GRPO groups), so its absence
    is an error here, naming what the object holds instead.
    """
    ref = source.get("agent_ref")
    if isinstance(ref, Mapping) and isinstance(ref.get("name"), str) and ref["name"]:
        return ref["name"]
    raise ValueError(
        f"no agent_ref.name (agent_ref = {ref!r}), so it cannot be routed to or attributed to an "
        f"agent; top-level fields: {sorted(source)[:12]}. A row names its agent in "
        "agent_ref.name and a Gym result echoes its row's agent_ref"
    )


# ---------------------------------------------------------------------------------------------
# OpenAI Chat Completions, with the token bundle
# ---------------------------------------------------------------------------------------------


class TextPart(BaseModel):
    """One text part of a list-shaped message content (NeMo-Gym sends user input this way)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The function part of a chat tool call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """A Chat Completions tool (`{type: "function", function: {...}}`); see :func:`chat_tools`."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(BaseModel):
    """One chat message, in a request's `messages` or as a completion's `choices[0].message`.

    Assistant messages may carry the token bundle (`prompt_token_ids`, `generation_token_ids`,
    `generation_log_probs`): the policy server returns it with every answer, and clients send it
    back on earlier turns so that the server can keep the exact tokens instead of re-tokenising
    text. Other roles may not carry it. `weight_version` is the policy server's other extra on an
    answer: the engine weights that produced it. `reasoning_content` is the model's reasoning,
    split from the answer by the server's reasoning parser (vLLM's field), and rendered back by
    templates that take it (Qwen3's). Unknown fields (`name`, `routed_experts`, vendor extras,
    ...) are ignored.
    """

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    prompt_token_ids: list[StrictInt] | None = None
    generation_token_ids: list[StrictInt] | None = None
    generation_log_probs: list[float] | None = None
    weight_version: int | None = None

    @model_validator(mode="after")
    def _check_fields_for_role(self) -> ChatMessage:
        if self.role != "assistant":
            if self.content is None:
                raise ValueError(
                    f"a {self.role!r} message needs `content` (only assistant may be null)"
                )
            if self.tool_calls:
                raise ValueError(
                    f"`tool_calls` is only allowed on assistant messages, not {self.role!r}"
                )
            carried = [name for name in TOKEN_FIELDS if getattr(self, name) is not None]
            if carried:
                raise ValueError(
                    f"{carried} are only allowed on assistant messages, not {self.role!r}"
                )
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError(
                "a 'tool' message needs `tool_call_id` (the id of the call it answers)"
            )
        if (self.prompt_token_ids is None) != (self.generation_token_ids is None):
            raise ValueError(
                "send `prompt_token_ids` and `generation_token_ids` together (both as the server "
                "returned them) or neither"
            )
        if self.generation_log_probs is not None and self.generation_token_ids is not None:
            ids, logprobs = len(self.generation_token_ids), len(self.generation_log_probs)
            if ids != logprobs:
                raise ValueError(
                    f"`generation_log_probs` has {logprobs} entries but `generation_token_ids` has "
                    f"{ids}; send both lists unchanged from the server's answer"
                )
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined; null content is empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @property
    def carries_token_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.generation_token_ids is not None


class ChatCompletionRequest(BaseModel):
    """A non-streaming chat completion request: the fields OpenAI clients commonly send.

    A null sampling field means OpenAI's default. Any other field is ignored. What a server
    cannot honour it refuses in its own subclass.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    required_prefix_token_ids: list[StrictInt] | None = Field(
        default=None,
        description="Gym's exact-prefix contract (its vllm_model_with_compaction adapter): the "
        "ids the prompt must start with, the previous call's prompt and generated ids, followed "
        "by what the template writes after the last assistant message; null (sent explicitly) "
        "at the first call of a segment, whose history the agent rewrote on purpose.",
    )

    @field_validator("temperature", "top_p", "n", "stream", "logprobs", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None or info.field_name is None:
            return value
        return cls.model_fields[info.field_name].default


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    """One choice of a completion: an assistant message whose token bundle is whole or absent."""

    model_config = ConfigDict(extra="ignore")

    index: int
    finish_reason: str
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None

    @field_validator("message")
    @classmethod
    def _an_answer_with_a_whole_bundle(cls, message: ChatMessage) -> ChatMessage:
        if message.role != "assistant":
            raise ValueError(f"a completion's message must be an assistant's, not {message.role!r}")
        present = [getattr(message, name) is not None for name in TOKEN_FIELDS]
        if any(present) and not all(present):
            missing = [name for name, there in zip(TOKEN_FIELDS, present, strict=True) if not there]
            raise ValueError(f"token bundle is incomplete: {missing} missing")
        return message


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    """A non-streaming OpenAI `ChatCompletion`: what the policy server answers, what agents read.

    `id`, `object`, `created`, `model` and at least one choice are required, as in OpenAI's API;
    `usage` is optional for readers and always sent by the policy server.
    """

    model_config = ConfigDict(extra="ignore")

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1)
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`; `max_model_len` is vLLM's extra, the context limit."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeAnswer(BaseModel):
    """vLLM's answer to `POST /tokenize`: the prompt's ids as generation would see them, their
    count and the context limit (Gym's compaction agent measures prompts with it)."""

    tokens: list[int]
    count: int
    max_model_len: int


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
    if message.text or not tool_calls:
        items.append(assistant_message_item(message.text))
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


def final_assistant_text(items: Sequence[Mapping[str, Any]]) -> str:
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
