"""Gym's exact-prefix contract on the policy server, over real HTTP on loopback with SmolLM2's
tokenizer: `required_prefix_token_ids` on `/v1/chat/completions` and `POST /tokenize`.

Gym's compaction agent (`simple_agent_with_compaction`, through its `vllm_model_with_compaction`
adapter) sends its history as text only and names the ids the prompt must start with: inside a
segment the previous call's prompt and sampled ids, `null` at a segment's first call, whose
history it rewrote on purpose. The engine's answer here is tokenised one byte-level token per
character, never how the tokenizer encodes the text, so a prompt re-rendered from text differs
from one that honours the prefix and the tests can tell them apart.
"""

from __future__ import annotations

import pytest

from gymrl.generation.server.divergence_watch import DivergenceCounts, DivergenceWatch
from gymrl.generation.server.route_store import RouteStore
from gymrl.generation.types import RouteLayout
from nemo_gym_ext.wire import ChatMessage
from tests.gymrl.generation.server.scripted_server import (
    KEY,
    MODEL,
    USER_ONLY,
    ScriptedEngine,
    char_level_reply,
    completion,
    served,
)

TAIL = "\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n<|im_start|>assistant\n"


def rendered(chat_format, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered whole from text, as without a prefix."""
    return chat_format.encode(
        chat_format.render([ChatMessage.model_validate(m) for m in messages], None)
    )


def error(response):
    return response.json()["error"]


def text_history(first: dict, *later: dict) -> list[dict]:
    """The first turn's question and answer as text (no ids), then `later` messages."""
    return [
        *USER_ONLY,
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        *later,
    ]


def sampled(first: dict) -> list[int]:
    """The first call's prompt and sampled ids: the prefix the agent requires next."""
    message = first["choices"][0]["message"]
    return [*message["prompt_token_ids"], *message["generation_token_ids"]]


def tokenize(client, messages, **fields):
    # Gym's adapter calls `{base_url without /v1}/tokenize`, as vLLM serves it.
    url = str(client.base_url).removesuffix("/v1/") + "/tokenize"
    return client.post(url, json={"model": MODEL, "messages": messages, **fields})


@pytest.fixture
def engine(tokenizer, chat_format):
    return ScriptedEngine(char_level_reply(tokenizer, chat_format, "five is the sum"))


def test_the_prompt_is_the_required_prefix_then_what_follows_the_last_assistant_message(
    chat_format, engine
):
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    with served(engine, chat_format) as client:
        first = completion(client, USER_ONLY).json()
        prefix = sampled(first)
        honoured = completion(
            client, text_history(first, follow_up), required_prefix_token_ids=prefix
        )
        left_out = completion(client, text_history(first, follow_up))
    assert honoured.status_code == 200, honoured.text
    prompt = honoured.json()["choices"][0]["message"]["prompt_token_ids"]
    # The generation ended with <|im_end|>, so the template's text after it starts with "\n".
    assert prompt == prefix + chat_format.encode(TAIL)
    assert list(engine.requests[1].prompt_token_ids) == prompt
    # Without the field the history is text only and re-rendered: the answer is re-tokenised.
    re_rendered = left_out.json()["choices"][0]["message"]["prompt_token_ids"]
    assert re_rendered == rendered(chat_format, text_history(first, follow_up))
    assert re_rendered[: len(prefix)] != prefix


def test_a_prefix_cut_before_the_end_of_turn_gets_it_from_the_template(chat_format, engine):
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    with served(engine, chat_format) as client:
        first = completion(client, USER_ONLY).json()
        prefix = sampled(first)[:-1]  # as if generation had stopped at its token limit
        response = completion(
            client, text_history(first, follow_up), required_prefix_token_ids=prefix
        )
    prompt = response.json()["choices"][0]["message"]["prompt_token_ids"]
    assert prompt == prefix + chat_format.encode("<|im_end|>" + TAIL)


def test_the_prefix_is_honoured_also_where_sent_back_ids_are_not(chat_format, engine):
    """`honor_prompt_token_ids=false` re-renders the ids clients send back on their messages;
    the prefix is the client's requirement, which it checks the prompt against."""
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    with served(engine, chat_format, honor_prompt_token_ids=False) as client:
        first = completion(client, USER_ONLY).json()
        response = completion(
            client, text_history(first, follow_up), required_prefix_token_ids=sampled(first)
        )
    prompt = response.json()["choices"][0]["message"]["prompt_token_ids"]
    assert prompt == sampled(first) + chat_format.encode(TAIL)


def test_a_prefix_the_server_cannot_honour_is_a_400_naming_it(tokenizer, chat_format, engine):
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    prompt_len = len(tokenizer.apply_chat_template(USER_ONLY, add_generation_prompt=True))
    with served(engine, chat_format, max_context_tokens=prompt_len + 40) as client:
        first = completion(client, USER_ONLY).json()
        history = text_history(first, follow_up)
        out_of_vocab = completion(client, history, required_prefix_token_ids=[1, 49152])
        negative = completion(client, history, required_prefix_token_ids=[-3])
        empty = completion(client, history, required_prefix_token_ids=[])
        no_anchor = completion(client, USER_ONLY, required_prefix_token_ids=sampled(first))
        not_ints = completion(client, history, required_prefix_token_ids=[1, "2"])
        too_long = completion(client, history, required_prefix_token_ids=[5] * (prompt_len + 40))
    for refused in (out_of_vocab, negative, empty, no_anchor):
        assert refused.status_code == 400, refused.text
        assert error(refused)["param"] == "required_prefix_token_ids"
    assert (
        "required_prefix_token_ids[1] = 49152 is not a token id" in error(out_of_vocab)["message"]
    )
    assert "required_prefix_token_ids[0] = -3" in error(negative)["message"]
    assert "is empty" in error(empty)["message"] and "null" in error(empty)["message"]
    assert "no message is an assistant's" in error(no_anchor)["message"]
    assert not_ints.status_code == 400
    assert "required_prefix_token_ids.1" in error(not_ints)["message"]
    # Gym's adapter turns a 400 naming the context length into the end of the episode.
    assert too_long.status_code == 400
    assert f"maximum context length is {prompt_len + 40} tokens" in error(too_long)["message"]
    assert len(engine.requests) == 1  # nothing refused reached the engine


@pytest.mark.parametrize("stop", [False, True])
def test_a_declared_segment_start_is_no_divergence(chat_format, engine, stop):
    """A compaction rewrites the history (here: the first answer's text dropped) and sends
    `required_prefix_token_ids: null`. The watch, which would call that history diverged (it no
    longer extends the answer the server wrote), leaves it unjudged: generated and uncounted.
    The same history without the field is a divergence, withheld when the watch stops them."""
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    watch = DivergenceWatch(capacity=64, stop=stop, marks_last_s=None)
    with served(engine, chat_format, divergence_watch=watch) as client:
        first = completion(client, USER_ONLY).json()
        compacted = text_history(first, follow_up)
        compacted[0] = {"role": "user", "content": "[earlier question omitted]"}
        declared = completion(client, compacted, required_prefix_token_ids=None)
        inside = declared.json()["choices"][0]["message"]
        next_call = completion(
            client,
            [*compacted, {"role": "assistant", "content": inside["content"]}, follow_up],
            required_prefix_token_ids=[
                *inside["prompt_token_ids"],
                *inside["generation_token_ids"],
            ],
        )
        undeclared = completion(client, compacted)
    assert watch.counts() == DivergenceCounts(detected=1, stopped=int(stop))
    for answered in (declared, next_call):
        assert answered.json()["choices"][0]["finish_reason"] == "stop", answered.text
    assert inside["prompt_token_ids"] == rendered(chat_format, compacted)
    withheld = undeclared.json()["choices"][0]["finish_reason"] == "content_filter"
    assert withheld == stop


def test_router_replay_asks_routes_from_the_prefixs_last_token(chat_format, engine):
    """The prefix's last token was sampled by the previous call and never run through the model:
    the call asks the engine for routes from there, as for sent-back ids."""
    store = RouteStore(
        RouteLayout(num_layers=2, experts_per_token=2, num_experts=8), max_bytes=1 << 20
    )
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    with served(engine, chat_format, route_store=store) as client:
        first = completion(client, USER_ONLY).json()
        prefix = sampled(first)
        completion(client, text_history(first, follow_up), required_prefix_token_ids=prefix)
        completion(client, text_history(first, follow_up), required_prefix_token_ids=None)
    assert [request.routes_from for request in engine.requests] == [0, len(prefix) - 1, 0]


def test_tokenize_answers_the_ids_generation_renders(tokenizer, chat_format, engine):
    follow_up = {"role": "user", "content": "And 3 + 4?"}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with served(engine, chat_format) as client:
        first = completion(client, USER_ONLY, tools=tools).json()
        history = text_history(first, follow_up)
        bodies = [
            {"tools": tools},
            {"tools": tools, "required_prefix_token_ids": sampled(first)},
            {"tools": tools, "required_prefix_token_ids": None},
        ]
        counted = [tokenize(client, history, **body) for body in bodies]
        generated = [completion(client, history, **body).json() for body in bodies]
    for answer, completed in zip(counted, generated, strict=True):
        assert answer.status_code == 200, answer.text
        prompt = completed["choices"][0]["message"]["prompt_token_ids"]
        assert answer.json() == {"tokens": prompt, "count": len(prompt), "max_model_len": 4096}
    assert counted[1].json()["tokens"][: len(sampled(first))] == sampled(first)


def test_tokenize_counts_an_overlong_prompt_and_refuses_what_generation_refuses(
    tokenizer, chat_format, engine
):
    long_question = [{"role": "user", "content": "word " * 40}]
    with served(engine, chat_format, max_context_tokens=30) as client:
        overlong = tokenize(client, long_question)
        no_key = client.post(
            str(client.base_url).removesuffix("/v1/") + "/tokenize",
            json={"model": MODEL, "messages": USER_ONLY},
            headers={"Authorization": "Bearer wrong"},
        )
        other_model = tokenize(client, USER_ONLY, model="gpt-4o")
        bad_prefix = tokenize(client, USER_ONLY, required_prefix_token_ids=[1])
        # 30 tokens x 1024 bytes each: the bound of a chat request's body.
        too_big = tokenize(client, [{"role": "user", "content": "x" * 40_000}])
    assert overlong.status_code == 200
    assert overlong.json()["count"] > 30 and overlong.json()["max_model_len"] == 30
    assert no_key.status_code == 401 and KEY not in no_key.text
    assert other_model.status_code == 404
    assert bad_prefix.status_code == 400
    assert error(bad_prefix)["param"] == "required_prefix_token_ids"
    assert too_big.status_code == 413
    assert engine.requests == []  # tokenizing generates nothing
