"""Prove, before anything starts, whether the policy's template keeps an episode append-only.

A run trains on one token sequence per episode, so each turn's prompt must start with the
previous turn's prompt and generation. Whether it does depends on the chat template and on what
the client sends back: with the ids sent back the policy server keeps them verbatim; with text
only it re-renders the history, and a template that writes an earlier turn differently from what
was generated (Qwen3's drops earlier reasoning once a new user message follows; its non-thinking
mode's empty think block is not written back into history) breaks the episode at that turn.

The probe plays a synthetic episode (a system message, a tool, a tool call and its output, a
final answer, a user follow-up: three model calls, with reasoning where the policy has a
reasoning parser) through the policy server's own prompt builder
(:func:`gymrl.generation.server.chat_template.build_prompt_token_ids`) with the policy's template
and parsers and a tokenizer on this machine, twice: with the ids sent back, and text only (the
server's answers re-sent unchanged minus their token fields: the best a text-only client can
do, so a break is the template's). Each generation is the family's own way of writing the turn
(its tool-call and reasoning syntax), tokenised canonically: a probe that passes does not promise
that a sampled, non-canonical tokenisation re-tokenises to the same ids.

A third client is Gym's compaction agent (`simple_agent_with_compaction`): it sends text only
but names the ids each prompt must start with (`required_prefix_token_ids`, the previous prompt
and generation inside a segment), and starts a new, declared segment where it rewrites the
history (reasoning recency drops an earlier reasoning block: a template such as Qwen3's, which
drops it anyway once a new user message follows, needs no more). Inside a segment the server
builds each prompt from the prefix (:func:`build_prompt_after_required_prefix`), so the verdict
says whether the template lets it: append-only, or the server's refusal.

It also says whether a configured `policy.chat_template` renders this model's chats the way the
template in the model's own folder does: a template made for another model (SmolLM2's default
system prompt on a Qwen model) renders silently otherwise.

Torch-free (the dry run imports no torch): the tokenizer is read with transformers' fast tokenizer
class directly, as `AutoTokenizer` would import torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from gymrl.config.schema.policy import PolicyConfig
from gymrl.generation.server.chat_template import (
    ChatFormat,
    ChatFormatError,
    build_prompt_after_required_prefix,
    build_prompt_token_ids,
)
from gymrl.generation.server.parsers import ParsedGeneration
from gymrl.model.folders import local_tokenizer_folder
from gymrl.model.tokens import decode_text
from nemo_gym_ext.wire import ChatMessage, FunctionSpec, ToolSpec

_TOOL = ToolSpec(
    function=FunctionSpec(
        name="add",
        description="Add two integers.",
        parameters={
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    )
)
_ARGUMENTS = {"a": 2, "b": 3}
_OPENING = [
    ChatMessage(role="system", content="You are a careful assistant. Use the tools you have."),
    ChatMessage(role="user", content="What is 2 + 3?"),
]
_REASONING = "The add tool gives the exact sum."
_ANSWER = "2 + 3 = 5."
_FOLLOW_UP = "Thanks. And 5 + 1?"
# How each family writes a tool call and its reasoning: the inverse of the parsers of the same
# name in gymrl.generation.server.parsers (tests/gymrl/preflight/test_template_probe.py holds them
# to it).
TOOL_CALL_WRITERS: Mapping[str, Callable[[str, dict[str, Any]], str]] = {
    "hermes": lambda name, arguments: (
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    ),
    "llama3_json": lambda name, arguments: json.dumps({"name": name, "parameters": arguments}),
}
# (how reasoning is written before the answer, the tag that closes it)
REASONING_WRITERS: Mapping[str, tuple[Callable[[str], str], str]] = {
    "qwen3": (lambda reasoning: f"<think>\n{reasoning}\n</think>\n\n", "</think>"),
}
PROBED_TURNS = 3


@dataclass(frozen=True)
class Divergence:
    """Where a turn's prompt stops starting with the previous prompt and generation."""

    turn: int
    position: int
    expected: str  # the previous prompt + generation from `position` on, decoded
    found: str  # this turn's prompt from `position` on, decoded
    token_expected: str
    token_found: str

    def describe(self) -> str:
        return (
            f"turn {self.turn}'s prompt differs at token {self.position}: {self.token_found!r} "
            f"where turn {self.turn - 1}'s prompt + generation has {self.token_expected!r} "
            f"(it reads {self.found!r}, the history {self.expected!r})"
        )


@dataclass(frozen=True)
class EpisodeVerdict:
    """One client's episode: each turn's divergence from its predecessor (turns 2 on; each turn
    is compared with the previous prompt + generation, whatever broke before), or the server's
    refusal of a turn, which ends the episode there."""

    divergences: tuple[Divergence, ...] = ()
    refused: str | None = None

    @property
    def append_only(self) -> bool:
        return not self.divergences and self.refused is None

    @property
    def divergence(self) -> Divergence | None:
        """The first turn that breaks the episode, where a run without truncation stops."""
        return self.divergences[0] if self.divergences else None

    def describe(self) -> str:
        if self.refused is not None:
            return f"the policy server refuses {self.refused}"
        if not self.divergences:
            return (
                f"append-only (turns 2-{PROBED_TURNS} each start with the previous prompt + "
                "generation)"
            )
        broken = {divergence.turn: divergence for divergence in self.divergences}
        turns = [
            broken[turn].describe()
            if turn in broken
            else f"turn {turn}'s prompt starts with turn {turn - 1}'s prompt + generation"
            for turn in range(2, PROBED_TURNS + 1)
        ]
        return "NOT append-only: " + "; ".join(turns)


@dataclass(frozen=True)
class TemplateProbe:
    """The probe of one policy: both clients' verdicts, or why it was not run.

    `template` names the template that renders, `folder` where the tokenizer was read; `replaced`
    says how a configured `policy.chat_template` compares with the one the model folder carries
    (None when the folder's own renders), and `replaces_differently` whether that is a warning.
    """

    template: str
    folder: Path | None = None
    not_run: str | None = None
    with_ids: EpisodeVerdict | None = None
    text_only: EpisodeVerdict | None = None
    required_prefix: EpisodeVerdict | None = None
    replaced: str | None = None
    replaces_differently: bool = False


def probe_policy(policy: PolicyConfig, *, honor_prompt_token_ids: bool) -> TemplateProbe:
    """Probe the template and parsers `policy` names with the tokenizer of its local folder."""
    template = (
        "the model folder's own chat template"
        if policy.chat_template is None
        else f"policy.chat_template={policy.chat_template}"
    )
    try:
        folder = local_tokenizer_folder(policy)
    except FileNotFoundError as error:
        return TemplateProbe(template, not_run=str(error))
    try:
        tokenizer = read_tokenizer(str(folder))
    except (OSError, ValueError) as error:
        return TemplateProbe(
            template,
            folder,
            not_run=f"no tokenizer the probe can read in {folder} ({type(error).__name__}: the "
            "probe reads tokenizer.json with transformers' fast tokenizer class, converting "
            "nothing)",
        )
    try:
        chat_format = ChatFormat.from_policy(policy, tokenizer)
    except ValueError as error:  # the policy server would refuse to start the same way
        return TemplateProbe(template, folder, not_run=str(error))
    with_ids, text_only, required_prefix = probe_chat_format(
        chat_format, honor_prompt_token_ids=honor_prompt_token_ids
    )
    replaced, differs = (
        (None, False)
        if policy.chat_template is None
        else compare_with_own_template(tokenizer, chat_format.template, folder)
    )
    return TemplateProbe(
        template,
        folder,
        with_ids=with_ids,
        text_only=text_only,
        required_prefix=required_prefix,
        replaced=replaced,
        replaces_differently=differs,
    )


@functools.cache
def read_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer (its tokenizer.json), read once per process."""
    return PreTrainedTokenizerFast.from_pretrained(folder)


def probe_chat_format(
    chat_format: ChatFormat, *, honor_prompt_token_ids: bool
) -> tuple[EpisodeVerdict, EpisodeVerdict, EpisodeVerdict]:
    """(with the ids sent back, text only, text with `required_prefix_token_ids` as Gym's
    compaction agent sends it inside a segment): the synthetic episode through the server's
    builder. The required prefix is honoured whatever `honor_prompt_token_ids` says (the
    contract names the prefix; it is not a sent-back id the server may ignore)."""
    return (
        _play(chat_format, client="ids", honor_prompt_token_ids=honor_prompt_token_ids),
        _play(chat_format, client="text", honor_prompt_token_ids=honor_prompt_token_ids),
        _play(chat_format, client="prefix", honor_prompt_token_ids=honor_prompt_token_ids),
    )


def _play(chat_format: ChatFormat, *, client: str, honor_prompt_token_ids: bool) -> EpisodeVerdict:
    """`client`: "ids" sends each answer back with its ids, "text" and "prefix" without, "prefix"
    naming the previous prompt + generation as the next prompt's required prefix."""
    messages = list(_OPENING)
    history: list[int] = []
    divergences: list[Divergence] = []
    for turn in range(1, PROBED_TURNS + 1):
        try:
            if client == "prefix" and history:
                built = build_prompt_after_required_prefix(messages, [_TOOL], chat_format, history)
            else:
                built = build_prompt_token_ids(
                    messages, [_TOOL], chat_format, honor_prompt_token_ids=honor_prompt_token_ids
                )
            prompt = built.token_ids
        except ChatFormatError as error:
            return EpisodeVerdict(tuple(divergences), refused=f"turn {turn}: {error}")
        if prompt[: len(history)] != history:
            divergences.append(_divergence(chat_format, turn, history, prompt))
        if turn == PROBED_TURNS:
            break
        generation = [
            *chat_format.encode(_written(chat_format, prompt, turn)),
            chat_format.end_of_turn_id,
        ]
        parsed = chat_format.parse(generation)
        messages.append(_answer_message(parsed, (prompt, generation) if client == "ids" else None))
        messages.append(_reply(parsed, turn))
        history = prompt + generation
    return EpisodeVerdict(tuple(divergences))


def _written(chat_format: ChatFormat, prompt: Sequence[int], turn: int) -> str:
    """What the family writes at `turn`: reasoning (unless the prompt already closed it, as
    Qwen3's non-thinking mode does), then a tool call on the first turn, an answer after."""
    parser = chat_format.parser
    answer = (
        TOOL_CALL_WRITERS[parser.tool_call_parser](_TOOL.function.name, _ARGUMENTS)
        if turn == 1
        else _ANSWER
    )
    if parser.reasoning_parser is None:
        return answer
    write, close = REASONING_WRITERS[parser.reasoning_parser]
    prompt_text = decode_text(chat_format.tokenizer, prompt, skip_special_tokens=False)
    return answer if prompt_text.rstrip().endswith(close) else write(_REASONING) + answer


def _answer_message(
    parsed: ParsedGeneration, token_ids: tuple[list[int], list[int]] | None
) -> ChatMessage:
    """The server's answer as a client sends it back: its parsed fields, and its (prompt,
    generation) ids where the client keeps them."""
    prompt_ids, generation_ids = token_ids or (None, None)
    return ChatMessage(
        role="assistant",
        content=parsed.content,
        tool_calls=parsed.tool_calls or None,
        reasoning_content=parsed.reasoning_content,
        prompt_token_ids=prompt_ids,
        generation_token_ids=generation_ids,
    )


def _reply(parsed: ParsedGeneration, turn: int) -> ChatMessage:
    """The environment's answer: the tool's output for the call, then the user's follow-up."""
    if turn == 1 and parsed.tool_calls:
        return ChatMessage(role="tool", content="5", tool_call_id=parsed.tool_calls[0].id)
    return ChatMessage(role="user", content=_FOLLOW_UP)


def _divergence(
    chat_format: ChatFormat, turn: int, history: Sequence[int], prompt: Sequence[int]
) -> Divergence:
    position = next(
        (i for i, (a, b) in enumerate(zip(history, prompt, strict=False)) if a != b),
        min(len(history), len(prompt)),
    )

    def text(ids: Sequence[int]) -> str:
        return decode_text(chat_format.tokenizer, ids, skip_special_tokens=False)

    return Divergence(
        turn=turn,
        position=position,
        expected=text(history[position : position + 12]),
        found=text(prompt[position : position + 12]) or "(the prompt ends)",
        token_expected=text(history[position : position + 1]),
        token_found=text(prompt[position : position + 1]) or "(the prompt ends)",
    )


# Tool-free chats, where a template that extends another with tools renders as that one does.
_TOOL_FREE_CHATS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hello."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye."},
    ],
)


def compare_with_own_template(
    tokenizer: PreTrainedTokenizerBase, configured: str, folder: Path
) -> tuple[str, bool]:
    """(what the plan says, whether it is a warning) of a configured template against the one
    the model folder carries: the same rendering of tool-free chats means it extends that one
    (as smollm2_tools extends SmolLM2's); another means it was made for another model."""
    own = tokenizer.chat_template
    if not isinstance(own, str):
        return f"the model folder {folder} carries no single chat template", False
    for messages in _TOOL_FREE_CHATS:
        theirs, ours = _render(tokenizer, own, messages), _render(tokenizer, configured, messages)
        if theirs != ours:
            start = next(
                (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                min(len(theirs), len(ours)),
            )
            shown = slice(ours.rfind("\n", 0, start) + 1, start + 50)
            return (
                f"renders this model's chats unlike the template its folder {folder} carries: "
                f"{ours[shown]!r} where the folder's template writes {theirs[shown]!r} (a "
                "template made for another model? set policy.chat_template=null to use the "
                "folder's own)",
                True,
            )
    return "renders tool-free chats as the model folder's own template does", False


def _render(
    tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict[str, str]]
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except (TemplateError, TypeError, ValueError, KeyError) as error:
        return f"(cannot render: {type(error).__name__}: {error})"
    assert isinstance(text, str)  # tokenize=False renders one conversation to one string
    return text
