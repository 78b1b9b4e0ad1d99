"""Property-based fuzzing of the policy server's `/v1/chat/completions` (hypothesis), over real
HTTP with the real torch engine on a tiny Llama.

Every request, however broken (arbitrary JSON, wrong types, huge numbers, NaN, unicode, deep
nesting, token ids outside the vocabulary, mismatched token bundles) gets a 2xx or a 4xx whose
message names the offending field, never a 5xx; and the server keeps serving valid requests
afterwards. The engine is real because some bad values only fail inside it (a seed beyond
2**64 used to fail the whole batch it landed in with a 500).
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.model.loading import build_tiny_llama
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.hostile_json import HUGE_INTS, JSON_VALUES, PATHOLOGICAL_BODIES, encode

MODEL, KEY = "tiny", "fuzz-key"
VALID = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 1.0,
    "seed": 1,
}
TOP_FIELDS = [
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "seed", "n", "stream", "stop", "logprobs", "top_logprobs",
    "return_tokens_as_token_ids", "parallel_tool_calls",
]  # fmt: skip
MESSAGE_FIELDS = [
    "role", "content", "tool_calls", "tool_call_id", "prompt_token_ids", "generation_token_ids",
    "generation_log_probs", "weight_version",
]  # fmt: skip


@pytest.fixture(scope="module")
def client(tokenizer, chat_format):
    model = build_tiny_llama(
        tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0
    )
    engine = TorchGenerationEngine.from_config(
        model, TorchGenerationConfig(max_batch_size=8), seed=0, compute_dtype="float32"
    )
    app = create_policy_server_app(
        engine,
        chat_format,
        model_name=MODEL,
        api_key=SecretStr(KEY),
        honor_prompt_token_ids=True,
        default_max_tokens=2,
        max_context_tokens=256,
        request_timeout_s=60,
        request_bytes_per_context_token=1024,  # 256 KiB at this context of 256 tokens
        render_timeout_s=60,
    )
    with (
        serve_in_thread(app, max_body_bytes=None) as server,
        httpx.Client(
            base_url=f"{server.url}/v1",
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=60,
        ) as http,
    ):
        yield http


def _post(client: httpx.Client, body) -> httpx.Response:
    return client.post("/chat/completions", content=encode(body))


def _check(response: httpx.Response, field: str | None) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"]
        if field is not None:
            assert field in f"{error['param']} {error['message']}", (field, error)


def _serves(client: httpx.Client) -> None:
    response = _post(client, VALID)
    assert response.status_code == 200, response.text[:500]
    message = response.json()["choices"][0]["message"]
    assert len(message["generation_token_ids"]) == len(message["generation_log_probs"]) > 0


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(body=JSON_VALUES)
def test_arbitrary_json_bodies_are_refused_with_a_4xx(client, body):
    _check(_post(client, body), None)


@FUZZ
@given(field=st.sampled_from(TOP_FIELDS), value=JSON_VALUES)
@example(field="seed", value=2**64)  # used to reach the engine and fail its whole batch
@example(field="temperature", value=float("nan"))
@example(field="max_tokens", value=10**30)
def test_any_value_in_any_top_level_field_is_answered_or_refused_by_name(client, field, value):
    _check(_post(client, {**VALID, field: value}), field)


@FUZZ
@given(field=st.sampled_from(MESSAGE_FIELDS), value=JSON_VALUES)
def test_any_value_in_any_message_field_is_answered_or_refused_by_name(client, field, value):
    assistant = {"role": "assistant", "content": "x", field: value}
    body = {**VALID, "messages": [{"role": "user", "content": "hi"}, assistant, *VALID["messages"]]}
    _check(_post(client, body), None if field == "role" else field)


@FUZZ
@given(
    prompt=st.lists(st.integers(min_value=-5, max_value=60_000) | HUGE_INTS, max_size=6),
    generated=st.lists(st.integers(min_value=-5, max_value=60_000) | HUGE_INTS, max_size=6),
    logprobs=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6),
)
def test_broken_token_bundles_are_refused_naming_the_bundle(client, prompt, generated, logprobs):
    """Ids outside the vocabulary, lists of different lengths, a prompt that is not the
    conversation's: each a 4xx about the bundle, or accepted when it is consistent."""
    assistant = {
        "role": "assistant",
        "content": "x",
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": logprobs,
    }
    body = {**VALID, "messages": [{"role": "user", "content": "hi"}, assistant, *VALID["messages"]]}
    response = _post(client, body)
    _check(response, None)
    if response.status_code >= 400:
        assert "token" in response.text or "log_probs" in response.text, response.text[:300]


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL_BODIES))
def test_pathological_bodies_are_4xx_and_the_server_keeps_serving(client, name):
    _check(_post(client, PATHOLOGICAL_BODIES[name]), None)
    _serves(client)


def test_the_server_still_serves_after_the_fuzzing(client):
    _serves(client)


# Requests the fuzzer and a review found answered 200: each is refused with a 400 naming the
# field (the first words of the expected message are checked too).
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
NAMED_REFUSALS = {
    "max_tokens_true": ({**VALID, "max_tokens": True}, "max_tokens"),
    "max_completion_tokens_true": (
        {**VALID, "max_completion_tokens": True},
        "max_completion_tokens",
    ),
    "seed_false": ({**VALID, "seed": False}, "seed"),
    "duplicate_tool_names": ({**VALID, "tools": [TOOL, TOOL]}, "tools"),
    "temperature_1e308": ({**VALID, "temperature": 1e308}, "temperature"),
    "positive_log_probs": (
        {
            **VALID,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "x",
                    "prompt_token_ids": [1, 2],
                    "generation_token_ids": [3],
                    "generation_log_probs": [0.5],
                },
                {"role": "user", "content": "again"},
            ],
        },
        "generation_log_probs",
    ),
    "tool_answer_to_no_call": (
        {
            **VALID,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "3", "tool_call_id": "call-7"},
            ],
        },
        "tool_call_id",
    ),
}


@pytest.mark.parametrize("name", sorted(NAMED_REFUSALS))
def test_values_that_used_to_be_answered_are_refused_by_name(client, name):
    body, field = NAMED_REFUSALS[name]
    response = _post(client, body)
    assert response.status_code == 400, response.text[:500]
    _check(response, field)


def test_a_tool_answer_to_an_earlier_call_and_a_max_tokens_beyond_the_context_are_served(client):
    """The refusals above leave what is right alone: a tool message answering the call before
    it, and a max_tokens far beyond the context, which is cut to the room left in it."""
    answered = {
        **VALID,
        "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "3", "tool_call_id": "call-1"},
        ],
    }
    assert _post(client, answered).status_code == 200
    huge = _post(client, {**VALID, "max_tokens": 10**12})
    assert huge.status_code == 200, huge.text[:300]
    usage = huge.json()["usage"]
    assert usage["total_tokens"] <= 256  # the server's max_context_tokens


def test_a_body_over_the_contexts_bound_is_refused_before_it_is_parsed(client):
    """The server's body bound (its context x generation.server.request_bytes_per_context_token:
    256 x 1024 bytes here) answers 413 from the declared length, before a byte is parsed or
    tokenised: 2 MB of text that would take seconds to tokenise and then not fit the context.
    tests/gymrl/generation/server/test_request_body.py shows it is refused before being read."""
    body = {**VALID, "messages": [{"role": "user", "content": "x " * 1_000_000}]}
    response = _post(client, body)
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "body" and str(256 * 1024) in error["message"]
    _serves(client)
