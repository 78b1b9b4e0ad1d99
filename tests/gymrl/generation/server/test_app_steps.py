"""The steps of a chat completion (`gymrl.generation.server.app.ChatCompletions` and its
functions), each run alone, without HTTP, with SmolLM2's tokenizer: the model check, the sampling
resolution, the max-tokens clamp, the render with its divergence verdict, the mapping from engine
exceptions to statuses. tests/gymrl/generation/server/test_app.py checks them behind the routes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from gymrl.generation.server.app import (
    ApiError,
    ChatCompletions,
    GenerationTimeoutError,
    PolicyServerRequest,
    check_model,
    engine_error,
    max_new_tokens,
    resolve_sampling,
)
from gymrl.generation.server.chat_template import ChatFormat, build_prompt_token_ids
from gymrl.generation.server.divergence_watch import DivergenceWatch, Verdict
from gymrl.generation.server.render_worker import RenderWorker
from gymrl.generation.server.sampling_rules import Sampling, SamplingParity, SamplingRules
from gymrl.generation.types import (
    EngineFailedError,
    EngineUnavailableError,
    GenerationOutput,
    GenerationRequest,
    UnsupportedRequestError,
)

MODEL = "smollm2-policy"
USER_ONLY = [{"role": "user", "content": "What is 2 + 3?"}]


def request(**fields) -> PolicyServerRequest:
    return PolicyServerRequest.model_validate({"messages": USER_ONLY, **fields})


class FutureEngine:
    """A `RequestScheduler` whose every request gets `future` (or raises `refuses` at submit)."""

    def __init__(self, future: Future[GenerationOutput], refuses: Exception | None = None):
        self.future = future
        self.refuses = refuses

    def submit(self, request: GenerationRequest) -> Future[GenerationOutput]:
        if self.refuses is not None:
            raise self.refuses
        return self.future

    def failure(self) -> EngineFailedError | None:
        return None


def completions(chat_format: ChatFormat, **overrides) -> ChatCompletions:
    settings = {
        "engine": FutureEngine(Future()),
        "chat_format": chat_format,
        "model_name": MODEL,
        "honor_prompt_token_ids": True,
        "default_max_tokens": 64,
        "max_context_tokens": 4096,
        "request_timeout_s": 10.0,
        "sampling_parity": None,
        "divergence_watch": None,
    }
    return ChatCompletions(**{**settings, **overrides})


def refusal(call) -> ApiError:
    with pytest.raises(ApiError) as raised:
        call()
    return raised.value


def test_a_request_naming_another_model_is_a_404_naming_the_served_one():
    check_model(request(), MODEL)
    check_model(request(model=MODEL), MODEL)
    error = refusal(lambda: check_model(request(model="gpt-4o"), MODEL))
    assert (error.status, error.error_type, error.param) == (404, "not_found_error", "model")
    assert f"this server serves {MODEL!r}" in error.message


def test_without_the_runs_rules_a_request_samples_as_it_asks_openais_defaults_filling_in():
    assert resolve_sampling(request(), None) == Sampling(1.0, 1.0)
    assert resolve_sampling(request(temperature=0.3, top_p=0.9), None) == Sampling(0.3, 0.9)
    assert resolve_sampling(request(temperature=0.0), None) == Sampling(0.0, 1.0)


def test_with_the_runs_rules_a_mismatch_is_overridden_or_a_400_naming_the_field():
    trained = Sampling(0.7, 0.95)
    override = SamplingParity(SamplingRules(trained, frozenset(), "override"))
    assert resolve_sampling(request(), override) == trained
    assert resolve_sampling(request(temperature=1.0), override) == trained
    reject = SamplingParity(SamplingRules(trained, frozenset(), "reject"))
    assert resolve_sampling(request(temperature=0.7, top_p=0.95), reject) == trained
    error = refusal(lambda: resolve_sampling(request(top_p=0.5), reject))
    assert (error.status, error.error_type, error.param) == (400, "invalid_request_error", "top_p")
    assert "sampling_mismatch=override" in error.message


@pytest.mark.parametrize(
    ("fields", "prompt_len", "expected"),
    [
        ({}, 10, 64),  # the server's default
        ({"max_tokens": 5}, 10, 5),
        ({"max_completion_tokens": 7}, 10, 7),
        ({"max_tokens": 5, "max_completion_tokens": 7}, 10, 5),  # max_tokens first
        ({"max_tokens": 500}, 90, 10),  # clamped to the room the prompt leaves
        ({}, 99, 1),
    ],
)
def test_max_tokens_is_what_the_request_asks_clamped_to_the_context(fields, prompt_len, expected):
    assert max_new_tokens(request(**fields), prompt_len, 64, 100) == expected


def test_a_prompt_that_fills_the_context_is_a_400_gym_reads_as_the_end_of_the_episode():
    error = refusal(lambda: max_new_tokens(request(), 100, 64, 100))
    assert (error.status, error.param) == (400, "messages")
    assert "maximum context length is 100 tokens" in error.message  # vllm_model's marker


@pytest.mark.parametrize(
    ("exception", "status", "error_type", "message"),
    [
        (GenerationTimeoutError("too slow"), 504, "timeout_error", "too slow"),
        (EngineUnavailableError("closed"), 503, "service_unavailable_error", "closed"),
        (EngineFailedError("step 3 failed"), 500, "server_error", "step 3 failed"),
        (ValueError("bad"), 500, "server_error", "engine.generate failed: ValueError: bad"),
    ],
)
def test_engine_exceptions_map_to_statuses(exception, status, error_type, message):
    error = engine_error(exception)
    assert (error.status, error.error_type, error.message, error.param) == (
        status,
        error_type,
        message,
        None,
    )


def test_a_request_the_engine_cannot_honour_is_a_400_naming_the_field():
    error = engine_error(UnsupportedRequestError("seed=3: ignored here", param="seed"))
    assert (error.status, error.error_type, error.param) == (400, "invalid_request_error", "seed")
    assert error.message == "seed=3: ignored here"


def test_generate_maps_a_refused_submit_and_a_deadline_and_cancels_the_late_generation(
    chat_format,
):
    unavailable = completions(
        chat_format, engine=FutureEngine(Future(), refuses=EngineUnavailableError("closing"))
    )
    prompt, _ = unavailable.render(request())
    generation = unavailable.generation_request(request(), prompt, Sampling(1.0, 1.0))
    error = refusal(lambda: asyncio.run(unavailable.generate(generation)))
    assert (error.status, error.message) == (503, "closing")

    never: Future[GenerationOutput] = Future()
    late = completions(chat_format, engine=FutureEngine(never), request_timeout_s=0.05)
    error = refusal(lambda: asyncio.run(late.generate(generation)))
    assert error.status == 504 and "request_timeout_s=0.05" in error.message
    assert never.cancelled()


def test_render_uses_the_chat_template_and_says_unknown_without_a_watch(chat_format):
    body = request()
    prompt, verdict = completions(chat_format).render(body)
    expected = build_prompt_token_ids(
        body.messages, body.tools, chat_format, honor_prompt_token_ids=True
    )
    assert prompt.token_ids == expected.token_ids
    assert verdict is Verdict.UNKNOWN


def test_render_refuses_sent_back_ids_outside_the_vocabulary_naming_the_field(chat_format):
    body = request(
        messages=[
            *USER_ONLY,
            {
                "role": "assistant",
                "content": "5",
                "prompt_token_ids": [1, 2, 3],
                "generation_token_ids": [chat_format.vocab_size],
                "generation_log_probs": [-0.1],
            },
            {"role": "user", "content": "And 3 + 4?"},
        ]
    )
    error = refusal(lambda: completions(chat_format).render(body))
    assert (error.status, error.error_type) == (400, "invalid_request_error")
    assert error.param == "messages[1].generation_token_ids"
    assert "is not a token id of this model" in error.message


def test_only_a_watch_that_stops_divergences_withholds_a_diverged_request(chat_format):
    stopping = completions(
        chat_format, divergence_watch=DivergenceWatch(capacity=4, stop=True, marks_last_s=None)
    )
    counting = completions(
        chat_format, divergence_watch=DivergenceWatch(capacity=4, stop=False, marks_last_s=None)
    )
    assert stopping.withholds(Verdict.DIVERGED)
    assert not stopping.withholds(Verdict.UNKNOWN)
    assert not counting.withholds(Verdict.DIVERGED)
    assert not completions(chat_format).withholds(Verdict.DIVERGED)


def test_the_generation_request_carries_the_sampling_the_clamp_and_the_turns_end(chat_format):
    body = request(max_tokens=500, seed=11)
    steps = completions(chat_format, max_context_tokens=100)
    prompt, _ = steps.render(body)
    generation = steps.generation_request(body, prompt, Sampling(0.5, 0.8))
    assert generation.prompt_token_ids == prompt.token_ids
    params = generation.params
    assert params.max_new_tokens == 100 - len(prompt.token_ids)
    assert (params.temperature, params.top_p, params.seed) == (0.5, 0.8, 11)
    assert params.stop_token_ids == chat_format.stop_token_ids


def test_answer_runs_the_steps_and_parses_the_generation(chat_format):
    reply = [*chat_format.encode("5"), chat_format.end_of_turn_id]
    done: Future[GenerationOutput] = Future()
    steps = completions(chat_format, engine=FutureEngine(done))
    prompt, _ = steps.render(request())
    done.set_result(
        GenerationOutput(
            token_ids=reply,
            logprobs=[-0.5] * len(reply),
            finish_reason="stop",
            weight_version=3,
            prompt_token_ids=prompt.token_ids,
        )
    )
    worker = RenderWorker(timeout_s=10.0)
    try:
        answer = asyncio.run(steps.answer(request(model=MODEL), worker))
    finally:
        assert worker.close(timeout_s=5.0)
    (choice,) = answer.choices
    assert (choice.message.content, choice.finish_reason) == ("5", "stop")
    assert choice.message.prompt_token_ids == prompt.token_ids
    assert choice.message.generation_token_ids == reply
    assert choice.message.weight_version == 3


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("default_max_tokens", 0, "default_max_tokens=0 must be >= 1"),
        ("max_context_tokens", 1, "max_context_tokens=1 must be >= 2"),
        ("request_timeout_s", 0.0, "request_timeout_s=0.0 must be > 0 seconds"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(chat_format, setting, value, message):
    with pytest.raises(ValueError, match=message):
        completions(chat_format, **{setting: value})
