"""Rendering round trips with real tokenizers and chat templates of three model families.

Each family: render a prompt with tools, generate (scripted) a tool call as that family writes it,
parse it, send it back with its token ids plus the tool's answer, and render the next turn: the
prompt starts with the sent-back ids and continues with what the family's template writes for
the later messages. Then a final answer and a user follow-up, the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from gymrl.generation.server.chat_template import (
    ChatFormat,
    ChatFormatError,
    build_prompt_token_ids,
)
from gymrl.generation.server.parsers import GenerationParser
from nemo_gym_ext.wire import ChatMessage, FunctionSpec, ToolSpec
from tests.gymrl.generation.server.scripted_server import ScriptedEngine, completion, served

ADD_TOOL = ToolSpec(
    function=FunctionSpec(
        name="add",
        description="Add two integers.",
        parameters={
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    )
)
QUESTION = ChatMessage(role="user", content="Add 2 and 3.")
HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@dataclass(frozen=True)
class Family:
    """One model family: its chat format, a tool call as it writes one, and what its template
    writes after an assistant turn for a tool answer "5" and for a user's "Thanks!"."""

    chat_format: ChatFormat
    tool_call_text: str
    reasoning: str | None
    after_tool_answer: str
    after_user_message: str
    # Whether re-rendering the whole conversation from text gives the same text as the prompt.
    rerender_matches_after_tool: bool
    rerender_matches_after_user: bool


QWEN_TOOL_ANSWER = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
CHATML_THANKS = "\n<|im_start|>user\nThanks!<|im_end|>\n"
NO_THINKING = "<think>\n\n</think>\n\n"


@pytest.fixture(params=["smollm2", "qwen3_thinking", "qwen3_no_thinking", "llama3"])
def family(request, chat_format, qwen3_tokenizer, llama3_tokenizer) -> Family:
    qwen_parser = GenerationParser("hermes", "qwen3")
    if request.param == "smollm2":
        return Family(
            chat_format,
            HERMES_CALL,
            None,
            "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
            CHATML_THANKS + "<|im_start|>assistant\n",
            rerender_matches_after_tool=True,
            rerender_matches_after_user=True,
        )
    if request.param == "qwen3_thinking":
        return Family(
            ChatFormat(qwen3_tokenizer, parser=qwen_parser),
            f"<think>\nAdding is a tool's job.\n</think>\n\n{HERMES_CALL}",
            "Adding is a tool's job.",
            QWEN_TOOL_ANSWER + "<|im_start|>assistant\n",
            CHATML_THANKS + "<|im_start|>assistant\n",
            rerender_matches_after_tool=True,
            # A new user query: Qwen3's template drops the earlier turns' reasoning.
            rerender_matches_after_user=False,
        )
    if request.param == "qwen3_no_thinking":
        return Family(
            ChatFormat(
                qwen3_tokenizer, parser=qwen_parser, template_kwargs={"enable_thinking": False}
            ),
            HERMES_CALL,
            None,
            QWEN_TOOL_ANSWER + "<|im_start|>assistant\n" + NO_THINKING,
            CHATML_THANKS + "<|im_start|>assistant\n" + NO_THINKING,
            # The generation prompt's empty think block is not re-rendered into history.
            rerender_matches_after_tool=False,
            rerender_matches_after_user=False,
        )
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    return Family(
        ChatFormat(llama3_tokenizer, parser=GenerationParser("llama3_json")),
        '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        None,
        header.format("ipython") + '"5"<|eot_id|>' + header.format("assistant"),
        header.format("user") + "Thanks!<|eot_id|>" + header.format("assistant"),
        rerender_matches_after_tool=True,
        rerender_matches_after_user=True,
    )


def generate(chat_format: ChatFormat, text: str) -> list[int]:
    """A scripted generation: the text's ids, closed by the end-of-turn token it stops at."""
    return [*chat_format.encode(text), chat_format.end_of_turn_id]


def test_tool_call_round_trip_keeps_sent_back_ids(family):
    chat_format = family.chat_format
    first = build_prompt_token_ids([QUESTION], [ADD_TOOL], chat_format, honor_prompt_token_ids=True)
    first_text = chat_format.tokenizer.decode(first.token_ids)
    assert '"name": "add"' in first_text and "Add two integers." in first_text

    generation = generate(chat_format, family.tool_call_text)
    parsed = chat_format.parse(generation)
    assert parsed.content is None and parsed.reasoning_content == family.reasoning
    (call,) = parsed.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}

    answer = ChatMessage(
        role="assistant",
        content=parsed.content,
        tool_calls=parsed.tool_calls,
        reasoning_content=parsed.reasoning_content,
        prompt_token_ids=first.token_ids,
        generation_token_ids=generation,
    )
    conversation = [QUESTION, answer, ChatMessage(role="tool", content="5", tool_call_id=call.id)]
    second = build_prompt_token_ids(
        conversation, [ADD_TOOL], chat_format, honor_prompt_token_ids=True
    )
    sent_back = first.token_ids + generation
    assert second.reused_from_message == 1 and second.reused_token_count == len(sent_back)
    assert second.token_ids == sent_back + chat_format.encode(family.after_tool_answer)
    rerendered = chat_format.render(conversation, [ADD_TOOL])
    assert (chat_format.tokenizer.decode(second.token_ids) == rerendered) == (
        family.rerender_matches_after_tool
    )

    final = generate(chat_format, "The sum is 5.")
    conversation += [
        ChatMessage(
            role="assistant",
            content="The sum is 5.",
            prompt_token_ids=second.token_ids,
            generation_token_ids=final,
        ),
        ChatMessage(role="user", content="Thanks!"),
    ]
    third = build_prompt_token_ids(
        conversation, [ADD_TOOL], chat_format, honor_prompt_token_ids=True
    )
    assert third.token_ids == [
        *second.token_ids,
        *final,
        *chat_format.encode(family.after_user_message),
    ]
    rerendered = chat_format.render(conversation, [ADD_TOOL])
    assert (chat_format.tokenizer.decode(third.token_ids) == rerendered) == (
        family.rerender_matches_after_user
    )


def test_an_unclosed_generation_gets_the_end_of_turn_token(family):
    """A generation cut by max_tokens lacks the end-of-turn token; the template's is added."""
    chat_format = family.chat_format
    first = build_prompt_token_ids([QUESTION], None, chat_format, honor_prompt_token_ids=True)
    cut = chat_format.encode("The sum")
    conversation = [
        QUESTION,
        ChatMessage(
            role="assistant",
            content="The sum",
            prompt_token_ids=first.token_ids,
            generation_token_ids=cut,
        ),
        ChatMessage(role="user", content="Thanks!"),
    ]
    prompt = build_prompt_token_ids(conversation, None, chat_format, honor_prompt_token_ids=True)
    tail = prompt.token_ids[len(first.token_ids) + len(cut) :]
    assert tail[0] == chat_format.end_of_turn_id
    assert tail[1:] == chat_format.encode(family.after_user_message)


def test_stop_tokens_are_the_turn_end_the_template_writes(qwen3_tokenizer, llama3_tokenizer):
    qwen = ChatFormat(qwen3_tokenizer, parser=GenerationParser("hermes"))
    llama = ChatFormat(llama3_tokenizer, parser=GenerationParser("llama3_json"))
    assert qwen3_tokenizer.convert_ids_to_tokens(list(qwen.stop_token_ids)) == ["<|im_end|>"]
    assert llama3_tokenizer.convert_ids_to_tokens(list(llama.stop_token_ids)) == ["<|eot_id|>"]


def test_a_template_whose_earlier_turns_depend_on_later_ones_is_refused(tokenizer, tmp_path):
    template = Path(tmp_path, "marks_answered_turns.jinja")
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.role == 'assistant' and not loop.last %} (answered){% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat_format = ChatFormat(
        tokenizer, parser=GenerationParser("hermes"), chat_template=str(template)
    )
    first = build_prompt_token_ids([QUESTION], None, chat_format, honor_prompt_token_ids=True)
    conversation = [
        QUESTION,
        ChatMessage(
            role="assistant",
            content="5",
            prompt_token_ids=first.token_ids,
            generation_token_ids=generate(chat_format, "5"),
        ),
        ChatMessage(role="user", content="Thanks!"),
    ]
    with pytest.raises(ChatFormatError) as raised:
        build_prompt_token_ids(conversation, None, chat_format, honor_prompt_token_ids=True)
    assert raised.value.param == "messages[1]"
    assert str(template) in str(raised.value)
    assert "honor_prompt_token_ids=false" in str(raised.value)


def test_a_tokenizer_without_a_template_or_a_turn_end_is_refused(tokenizer, tmp_path):
    plain = Path(tmp_path, "no_turn_end.jinja")
    plain.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(ValueError, match="does not close an assistant turn with a special token"):
        ChatFormat(tokenizer, parser=GenerationParser("hermes"), chat_template=str(plain))
    templateless = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templateless.chat_template = None
    with pytest.raises(ValueError, match=r"carries no chat template.*smollm2_tools"):
        ChatFormat(templateless, parser=GenerationParser("hermes"))


def test_a_template_error_is_a_request_error_naming_the_template(llama3_tokenizer):
    llama = ChatFormat(llama3_tokenizer, parser=GenerationParser("llama3_json"))
    calls = [{"id": f"c{i}", "function": {"name": "add", "arguments": "{}"}} for i in range(2)]
    two_calls = ChatMessage(role="assistant", content=None, tool_calls=calls)
    with pytest.raises(ChatFormatError, match="only supports single tool-calls") as raised:
        llama.render([QUESTION, two_calls], None)
    assert raised.value.param == "messages"
    assert "the chat template of" in str(raised.value)


def test_qwen3_over_http_answer_carries_reasoning_and_calls_and_the_ids_come_back(
    qwen3_tokenizer,
):
    """The policy server with Qwen3's format: the answer splits reasoning from the tool call,
    generation stops at <|im_end|>, and a client that sends the message back unchanged (as Gym
    agents do) gets a next prompt that starts with the ids it sent."""
    qwen = ChatFormat(qwen3_tokenizer, parser=GenerationParser("hermes", "qwen3"))
    engine = ScriptedEngine(generate(qwen, f"<think>\nUse the tool.\n</think>\n\n{HERMES_CALL}"))
    tools = [ADD_TOOL.model_dump(exclude_none=True)]
    question = QUESTION.model_dump(exclude_none=True)
    with served(engine, qwen) as client:
        first = completion(client, [question], tools=tools)
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        assert first.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert message["reasoning_content"] == "Use the tool."
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        tool_answer = {"role": "tool", "content": "5", "tool_call_id": call["id"]}
        second = completion(client, [question, message, tool_answer], tools=tools)
        assert second.status_code == 200, second.text
    assert engine.requests[0].params.stop_token_ids == (qwen.end_of_turn_id,)
    sent_back = message["prompt_token_ids"] + message["generation_token_ids"]
    assert engine.requests[1].prompt_token_ids[: len(sent_back)] == sent_back
    assert engine.requests[1].prompt_token_ids[len(sent_back) :] == qwen.encode(
        QWEN_TOOL_ANSWER + "<|im_start|>assistant\n"
    )
