"""Render OpenAI chat messages (and tools) with the model's own chat template; keep sent-back ids.

The policy server is token-in / token-out towards its engine, so this module decides the
exact prompt tokens of every model call. Two rules matter for training:

* Prompts are rendered by the chat template the model was trained with: the tokenizer's own
  `chat_template` (through transformers' `apply_chat_template`, tools and template variables such
  as Qwen3's `enable_thinking` passed as the template takes them), or a Jinja file named by
  `policy.chat_template` for a model whose own template lacks something the recipe needs
  (SmolLM2's cannot render tools; the recipe ships `templates/smollm2_tools.jinja` for it). No
  template is special-cased here: whatever the template writes is the prompt.
* The on-policy prefix fix (:func:`build_prompt_token_ids`): when a client sends back the token
  ids of an earlier assistant turn, the prompt reuses those exact ids and renders only the
  messages after that turn. Re-rendering and re-tokenising the history instead (BPE merges a
  boundary differently, tool-call JSON re-serialised with other whitespace, Qwen3's template
  dropping earlier reasoning) gives a prompt that does not start with what the sampler saw, and
  the episode stops being contiguous.
* Gym's exact-prefix contract (:func:`build_prompt_after_required_prefix`): a client that
  rewrites its history on purpose (Gym's compaction agent) sends no ids on its messages but
  names the ids the prompt must start with, `required_prefix_token_ids`; the prompt is those ids
  and what the template writes after the last assistant message, rendered the same way.

The message types are the wire vocabulary of `nemo_gym_ext.wire`, shared with the Gym agents.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from gymrl.generation.server.parsers import GenerationParser, ParsedGeneration
from gymrl.generation.server.templates import bundled_chat_templates, chat_template_path
from gymrl.model.tokens import decode_text, eos_token_id
from nemo_gym_ext.wire import (
    ChatMessage,
    ResponsesCreateParams,
    ToolSpec,
    chat_tools,
    items_to_chat_messages,
)

if TYPE_CHECKING:
    from gymrl.config.schema.policy import PolicyConfig


# The request field of Gym's exact-prefix contract (build_prompt_after_required_prefix).
REQUIRED_PREFIX_PARAM = "required_prefix_token_ids"
# How a client of sent-back ids gets its history rendered from text instead.
_HONOR_OFF = "set generation.server.honor_prompt_token_ids=false"


class ChatFormatError(ValueError):
    """A request the chat format cannot render; `param` names the offending field."""

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PromptTokens:
    """The prompt of one model call and how much of it was taken verbatim from the client.

    `reused_from_message` is the index of the assistant message whose ids start the prompt (its
    own `prompt_token_ids + generation_token_ids`, or the request's `required_prefix_token_ids`
    ending with it; None when the whole conversation was rendered from text);
    `reused_token_count` is the length of that verbatim prefix.
    """

    token_ids: list[int]
    reused_from_message: int | None
    reused_token_count: int


class ChatFormat:
    """One model's chat template, its tokenizer and its output parsers.

    Not thread-safe (Hugging Face fast tokenizers may fail when used from several threads at
    once); the policy server calls it from a single worker thread.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        parser: GenerationParser,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        model_end_ids: Sequence[int] = (),
    ):
        """`model_end_ids`: the end ids the model's config declares
        (:func:`gymrl.model.tokens.model_end_token_ids`), stop ids of every turn."""
        self.tokenizer = tokenizer
        self.parser = parser
        self.template_kwargs = dict(template_kwargs or {})
        if chat_template is None:
            own = tokenizer.chat_template
            if not isinstance(own, str):
                raise ValueError(
                    f"the tokenizer {tokenizer.name_or_path!r} carries no chat template (or "
                    "several named ones); set policy.chat_template to a Jinja file or to one of "
                    f"the recipe's templates ({', '.join(bundled_chat_templates())})"
                )
            self.template = own
            self.template_name = f"the chat template of {tokenizer.name_or_path!r}"
        else:
            self.template = chat_template_path(chat_template).read_text()
            self.template_name = f"the chat template {chat_template!r}"
        self.vocab_size = len(tokenizer)
        self.end_of_turn_id = self._end_of_turn_id()
        self.end_of_turn_text = decode_text(
            tokenizer, [self.end_of_turn_id], skip_special_tokens=False
        )
        # The model may also end its answer with its end-of-sequence token (a base model does),
        # or with an end id its own config declares, where SGLang stops it anyway.
        self.stop_token_ids = tuple(
            dict.fromkeys([self.end_of_turn_id, eos_token_id(tokenizer), *model_end_ids])
        )

    @classmethod
    def from_policy(
        cls,
        policy: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_end_ids: Sequence[int] = (),
    ) -> ChatFormat:
        return cls(
            tokenizer,
            parser=GenerationParser(policy.tool_call_parser, policy.reasoning_parser),
            chat_template=policy.chat_template,
            template_kwargs=policy.chat_template_kwargs,
            model_end_ids=model_end_ids,
        )

    def _end_of_turn_id(self) -> int:
        """The token the template closes an assistant turn with: generation stops there."""
        marker = _marker()
        text = self.render_dicts(
            [{"role": "user", "content": "ping"}, {"role": "assistant", "content": marker}],
            None,
            add_generation_prompt=False,
        )
        after = text[text.rindex(marker) + len(marker) :] if marker in text else ""
        ids = self.encode(after)
        if not ids or ids[0] not in self.tokenizer.added_tokens_decoder:
            raise ValueError(
                f"{self.template_name} does not close an assistant turn with a special token "
                f"(after the answer it writes {after[:40]!r}), so generation has no token to stop "
                "at; use a chat template made for this tokenizer (policy.chat_template)"
            )
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens (the closing end-of-turn token) dropped."""
        return decode_text(self.tokenizer, token_ids, skip_special_tokens=True)

    def parse(self, token_ids: Sequence[int]) -> ParsedGeneration:
        """Reasoning, answer text and tool calls of a generation, by the model family's parsers."""
        return self.parser.parse(self.decode(token_ids))

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] | None,
        *,
        add_generation_prompt: bool = True,
        first_index: int = 0,
    ) -> str:
        """The conversation as the template writes it; `first_index` numbers errors' messages."""
        dicts = [
            _template_message(message, index)
            for index, message in enumerate(messages, start=first_index)
        ]
        return self.render_dicts(dicts, tools, add_generation_prompt=add_generation_prompt)

    def render_dicts(
        self,
        messages: list[dict[str, Any]],
        tools: Sequence[ToolSpec] | None,
        *,
        add_generation_prompt: bool,
    ) -> str:
        schemas: list[dict[Any, Any] | Callable[..., Any]] | None = (
            [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=schemas,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as error:
            raise ChatFormatError(
                f"{self.template_name} cannot render this conversation: "
                f"{type(error).__name__}: {error}",
                param="messages",
            ) from error
        assert isinstance(text, str)  # tokenize=False renders one conversation to one string
        return text

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
    chat_format: ChatFormat,
    *,
    honor_prompt_token_ids: bool,
) -> PromptTokens:
    """The prompt token ids of a chat request, honouring earlier token ids when asked to.

    With `honor_prompt_token_ids` and an assistant message carrying `prompt_token_ids` and
    `generation_token_ids` (the anchor: the LAST such message), the prompt is the anchor's
    `prompt_token_ids + generation_token_ids` verbatim, then what the template writes after the
    anchor: the rest of the anchor's turn (its end-of-turn token too when the generation did not
    end with it), the later messages and the generation prompt. That text is the difference
    between rendering the conversation with and without the later messages (see
    :func:`_text_after_anchor`). Everything up to the anchor is inside its ids, tools included,
    so it is not rendered again. Otherwise the whole conversation is rendered and tokenised.

    Only the ids that enter the prompt are range-checked; a bad one raises
    :class:`ChatFormatError` naming the message index and field.
    """
    anchor = _last_index_with_token_ids(messages) if honor_prompt_token_ids else None
    if anchor is None:
        ids = chat_format.encode(chat_format.render(messages, tools))
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
    closed = bool(generation_ids) and generation_ids[-1] == chat_format.end_of_turn_id
    prefix = [*prompt_ids, *generation_ids]
    return _prompt_after_anchor(
        messages, tools, chat_format, anchor, prefix, closed=closed, text_instead=_HONOR_OFF
    )


def build_prompt_after_required_prefix(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] | None,
    chat_format: ChatFormat,
    required_prefix: Sequence[int],
) -> PromptTokens:
    """The prompt of a request under Gym's exact-prefix contract (`required_prefix_token_ids`).

    Gym's compaction agent strips the token ids from the history it sends and instead names the
    ids the prompt must start with: inside a segment, the previous call's prompt and sampled
    ids. The prompt is exactly `required_prefix`, then what the template writes after the LAST
    assistant message (the anchor; the previous call's answer), as for sent-back ids
    (:func:`_text_after_anchor`, `closed` when the prefix ends with the end-of-turn token). The
    anchor's own ids, if it carries any, are not read: the contract names the prefix.

    Never a re-render: an empty prefix, an id outside the vocabulary, or a history with no
    assistant message to anchor on raises :class:`ChatFormatError` naming
    `required_prefix_token_ids` (the agent checks the prompt against the prefix and fails the
    whole rollout on a mismatch, so a prompt that ignored it would only fail later).
    """
    param = REQUIRED_PREFIX_PARAM
    if not required_prefix:
        raise ChatFormatError(
            f"{param} is empty; send the previous call's prompt and generated ids, or null for "
            "a call that starts a segment (the prompt is then rendered from the messages)",
            param=param,
        )
    chat_format.check_token_ids(required_prefix, param=param)
    anchor = next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None
    )
    if anchor is None:
        raise ChatFormatError(
            f"{param} is given but no message is an assistant's, so there is no turn for the "
            "prefix to end with and nothing to render after it; send the previous call's answer "
            f"as an assistant message, or {param}=null for a call that starts a segment",
            param=param,
        )
    closed = required_prefix[-1] == chat_format.end_of_turn_id
    prefix = list(required_prefix)
    return _prompt_after_anchor(
        messages,
        tools,
        chat_format,
        anchor,
        prefix,
        closed=closed,
        text_instead=f"send {param}=null (the prompt is then rendered from the messages)",
    )


def _prompt_after_anchor(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] | None,
    chat_format: ChatFormat,
    anchor: int,
    prefix: list[int],
    *,
    closed: bool,
    text_instead: str,
) -> PromptTokens:
    """`prefix` (the ids ending with messages[anchor]'s answer) verbatim, then the template's
    text after the anchor; `text_instead` is how the client renders from text instead, for the
    refusal of a template that cannot append."""
    suffix = _text_after_anchor(
        messages, tools, anchor, chat_format, closed=closed, text_instead=text_instead
    )
    return PromptTokens(
        token_ids=prefix + chat_format.encode(suffix),
        reused_from_message=anchor,
        reused_token_count=len(prefix),
    )


def row_prompt_token_count(row: Mapping[str, Any], chat_format: ChatFormat) -> int:
    """Tokens of a Gym row's prompt (its input items and tools) as the policy server renders
    the first model call of an episode: what its context must hold before generating."""
    params = ResponsesCreateParams.model_validate(row["responses_create_params"])
    messages = [
        ChatMessage.model_validate(message)
        for message in items_to_chat_messages(params.input, include_token_ids=False)
    ]
    tools = [ToolSpec.model_validate(tool) for tool in chat_tools(params.tools)] or None
    prompt = build_prompt_token_ids(messages, tools, chat_format, honor_prompt_token_ids=False)
    return len(prompt.token_ids)


def _text_after_anchor(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] | None,
    anchor: int,
    chat_format: ChatFormat,
    *,
    closed: bool,
    text_instead: str,
) -> str:
    """What the template writes after the anchor's answer, by rendering with and without the
    later messages and keeping the difference.

    The anchor's text is replaced by a unique marker in both renderings: its ids are kept
    verbatim, so how the template would write it does not matter, and templates do write it
    differently by context (Qwen3's adds an empty think block to an assistant message that ends
    the conversation, and drops reasoning once a new user message follows). Where the marker
    appears, the renderings are compared from it on; where the template drops an answer's text
    (Llama 3's, for a message with tool calls) they are compared whole. Either way the rendering
    without the later messages must be a prefix of the one with them (the difference a true
    suffix), or the request is refused naming the template.
    """
    marker = _marker()
    anchor_message = _template_message(messages[anchor], anchor)
    anchor_message["content"] = marker
    anchor_message.pop("reasoning_content", None)
    history = [_template_message(m, i) for i, m in enumerate(messages[:anchor])]
    later = [
        _template_message(m, i) for i, m in enumerate(messages[anchor + 1 :], start=anchor + 1)
    ]
    without = chat_format.render_dicts(
        [*history, anchor_message], tools, add_generation_prompt=False
    )
    with_later = chat_format.render_dicts(
        [*history, anchor_message, *later], tools, add_generation_prompt=True
    )
    if without.count(marker) == 1 and with_later.count(marker) == 1:
        without = without[without.index(marker) :]
        with_later = with_later[with_later.index(marker) :]
    end_of_turn = chat_format.end_of_turn_text
    if not with_later.startswith(without) or end_of_turn not in without:
        placeholder = f"<text of messages[{anchor}]>"
        shown_without = without.replace(marker, placeholder)
        shown_with = with_later.replace(marker, placeholder)
        ends = shown_without[-80:]
        reads = shown_with[max(0, len(shown_without) - 80) : len(shown_without) + 30]
        raise ChatFormatError(
            f"{chat_format.template_name} renders the conversation up to messages[{anchor}] "
            "differently when later messages follow, so the later messages cannot be appended "
            f"to that turn's token ids (its turn ends {ends!r} without them, the rendering with "
            f"them reads {reads!r} "
            "there); use a template whose earlier turns do not depend on later ones "
            f"(policy.chat_template) or {text_instead}",
            param=f"messages[{anchor}]",
        )
    closing = without[without.rindex(end_of_turn) :]
    if closed:
        closing = closing[len(end_of_turn) :]
    return closing + with_later[len(without) :]


def _marker() -> str:
    """A string no template rewrites (no whitespace to trim) and no message contains."""
    return f"gymrl{uuid.uuid4().hex}"


def _last_index_with_token_ids(messages: Sequence[ChatMessage]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "assistant" and messages[index].carries_token_ids:
            return index
    return None


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates take it: string content, tool-call arguments as a mapping."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments, index, position),
                },
            }
            for position, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    return rendered


def _arguments(arguments: str, index: int, position: int) -> Any:
    param = f"messages[{index}].tool_calls[{position}].function.arguments"
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as error:
        raise ChatFormatError(
            f"{param} is not valid JSON ({error.msg} at position {error.pos}): "
            f"{arguments[:80]!r}; send the arguments as a JSON object string",
            param=param,
        ) from error
