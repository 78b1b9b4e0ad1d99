"""The policy model server over real HTTP on loopback, with SmolLM2's tokenizer.

One test serves the SGLang engine over the loopback SGLang stand-in. Most tests drive a
scripted engine (a real `GenerationEngine` that answers every request with a
fixed token sequence) because the server's job is rendering, parsing and batching, and a script
lets a test choose the exact generated tokens: tool calls, non-canonical tokenisations, length
cut-offs. One test runs the real `TorchGenerationEngine` on a tiny random Llama.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.generation.server.divergence_watch import DivergenceCounts, DivergenceWatch
from gymrl.generation.server.sampling_rules import (
    Sampling,
    SamplingCounts,
    SamplingParity,
    SamplingRules,
)
from gymrl.generation.sglang.engine import SGLangEngine
from gymrl.generation.torch.engine import TorchGenerationEngine
from gymrl.model.loading import build_tiny_llama
from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.json_body import OFF_LOOP_BODY_BYTES
from tests.gymrl.generation.server.scripted_server import (
    MODEL,
    USER_ONLY,
    ScriptedEngine,
    char_level_reply,
    completion,
    scripted,
    served,
)
from tests.support.sglang_standin import make_standin


def error_message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def test_answer_is_a_full_chat_completion_with_the_token_bundle(tokenizer, chat_format):
    engine = scripted(chat_format, "2 + 3 = 5.")
    with served(engine, chat_format) as client:
        response = completion(client, USER_ONLY, temperature=0.7, top_p=0.9, seed=3)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"].startswith("chatcmpl-")
    assert answer["object"] == "chat.completion"
    assert isinstance(answer["created"], int)
    assert answer["model"] == MODEL
    choice = answer["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] == "2 + 3 = 5."
    assert message["tool_calls"] is None
    assert message["weight_version"] == 7

    expected_prompt = tokenizer.apply_chat_template(USER_ONLY, add_generation_prompt=True)
    assert message["prompt_token_ids"] == expected_prompt["input_ids"]
    assert list(engine.requests[0].prompt_token_ids) == message["prompt_token_ids"]
    assert message["generation_token_ids"] == engine.reply
    assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])

    params = engine.requests[0].params
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 3)
    assert params.stop_token_ids == (chat_format.end_of_turn_id,)
    assert params.max_new_tokens == 64

    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in engine.reply]
    assert [e["logprob"] for e in entries] == message["generation_log_probs"]
    assert answer["usage"] == {
        "prompt_tokens": len(expected_prompt["input_ids"]),
        "completion_tokens": len(engine.reply),
        "total_tokens": len(expected_prompt["input_ids"]) + len(engine.reply),
    }


def test_tool_calls_are_parsed_into_message_tool_calls(tokenizer, chat_format):
    engine = scripted(
        chat_format,
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 1}}\n</tool_call>',
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    with served(engine, chat_format) as client:
        response = completion(
            client, USER_ONLY, tools=tools, parallel_tool_calls=True, max_tokens=200
        )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [call["type"] for call in calls] == ["function", "function"]
    assert all(call["id"].startswith("call_") for call in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert [json.loads(call["function"]["arguments"]) for call in calls] == [
        {"a": 2, "b": 3},
        {"a": 5, "b": 1},
    ]
    prompt_text = tokenizer.decode(message["prompt_token_ids"])
    assert json.dumps(tools[0]) in prompt_text and "<tool_call>" in prompt_text


def test_malformed_tool_call_comes_back_as_content(tokenizer, chat_format):
    engine = scripted(
        chat_format, 'Calling.<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>'
    )
    with served(engine, chat_format) as client:
        response = completion(client, USER_ONLY)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["tool_calls"] is None
    assert (
        choice["message"]["content"]
        == 'Calling.<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>'
    )


def test_developer_assistant_tool_call_and_tool_turns_are_rendered(tokenizer, chat_format):
    conversation = [
        {"role": "system", "content": "You add numbers."},
        {"role": "developer", "content": "Always use the tool."},
        {"role": "user", "content": [{"type": "text", "text": "2+3?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": "call_a"},
    ]
    engine = scripted(chat_format, "5")
    with served(engine, chat_format) as client:
        response = completion(client, conversation)
    assert response.status_code == 200, response.text
    expected = (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>developer\nAlways use the tool.<|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n5<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    prompt = response.json()["choices"][0]["message"]["prompt_token_ids"]
    assert prompt == tokenizer.encode(expected, add_special_tokens=False)


def second_turn(first_answer: dict) -> list[dict]:
    message = first_answer["choices"][0]["message"]
    return [
        *USER_ONLY,
        {
            "role": "assistant",
            "content": message["content"],
            "prompt_token_ids": message["prompt_token_ids"],
            "generation_token_ids": message["generation_token_ids"],
            "generation_log_probs": message["generation_log_probs"],
        },
        {"role": "user", "content": "And 3 + 4?"},
    ]


@pytest.mark.parametrize("honor", [True, False])
def test_earlier_token_ids_are_kept_only_when_honoured(tokenizer, chat_format, honor):
    engine = ScriptedEngine(char_level_reply(tokenizer, chat_format, "five is the sum"))
    with served(engine, chat_format, honor_prompt_token_ids=honor) as client:
        first = completion(client, USER_ONLY).json()
        second = completion(client, second_turn(first))
    assert second.status_code == 200, second.text
    earlier = [
        *first["choices"][0]["message"]["prompt_token_ids"],
        *first["choices"][0]["message"]["generation_token_ids"],
    ]
    prompt = second.json()["choices"][0]["message"]["prompt_token_ids"]
    assert list(engine.requests[1].prompt_token_ids) == prompt
    rendered = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in second_turn(first)],
        add_generation_prompt=True,
    )["input_ids"]
    if honor:
        tail = "\n<|im_start|>user\nAnd 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
        assert prompt == earlier + tokenizer.encode(tail, add_special_tokens=False)
    else:
        assert prompt == rendered
        assert prompt[: len(earlier)] != earlier


def _tiny_torch_engine(tokenizer, **generation):
    """The torch engine on a tiny random Llama, decoding through the model's own forward unless a
    test asks for the fused step (tests count the forward's calls)."""
    model = build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=0
    )
    config = TorchGenerationConfig(**({"decode_path": "transformers"} | generation))
    return TorchGenerationEngine.from_config(model, config, seed=0, compute_dtype="float32")


def test_concurrent_requests_decode_together_and_each_gets_its_own_answer(tokenizer, chat_format):
    engine = _tiny_torch_engine(tokenizer, max_batch_size=8)
    widths: list[int] = []

    def slow_step(_module, _args, kwargs):
        # Each step takes 50 ms more, so every request has arrived before the first one ends.
        widths.append(kwargs["input_ids"].shape[0])
        time.sleep(0.05)

    hook = engine._model.base_model.register_forward_pre_hook(slow_step, with_kwargs=True)
    try:
        with (
            served(engine, chat_format, request_timeout_s=120.0) as client,
            ThreadPoolExecutor(8) as pool,
        ):
            questions = [[{"role": "user", "content": f"question {i}"}] for i in range(8)]
            responses = list(
                pool.map(lambda messages: completion(client, messages, max_tokens=40), questions)
            )
    finally:
        hook.remove()
        engine.close()
    assert [r.status_code for r in responses] == [200] * 8
    assert max(widths) > 1, "no decode step held more than one request"
    for question, response in zip(questions, responses, strict=True):
        prompt = response.json()["choices"][0]["message"]["prompt_token_ids"]
        assert question[0]["content"] in tokenizer.decode(prompt)


def test_api_key_is_required(tokenizer, chat_format):
    with served(scripted(chat_format, "ok"), chat_format) as client:
        body = {"model": MODEL, "messages": USER_ONLY}
        missing = client.post("/chat/completions", json=body, headers={"Authorization": ""})
        wrong = client.post("/chat/completions", json=body, headers={"Authorization": "Bearer no"})
        models = client.get("/models", headers={"Authorization": "Bearer no"})
        allowed = client.post("/chat/completions", json=body)
    assert (missing.status_code, wrong.status_code, models.status_code) == (401, 401, 401)
    assert "Authorization: Bearer" in error_message(wrong)
    assert allowed.status_code == 200
    assert allowed.json()["choices"][0]["logprobs"] is None


def test_models_route_lists_the_served_model(tokenizer, chat_format):
    with served(scripted(chat_format, "ok"), chat_format, api_key=None) as client:
        response = client.get("/models", headers={"Authorization": ""})
    assert response.status_code == 200
    listing = response.json()
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in listing["data"]] == [
        (MODEL, "model", 4096)
    ]


def assistant_with_ids(prompt_ids, generation_ids) -> dict:
    return {
        "role": "assistant",
        "content": "x",
        "prompt_token_ids": prompt_ids,
        "generation_token_ids": generation_ids,
        "generation_log_probs": [-0.1] * len(generation_ids),
    }


def test_bad_requests_are_400_naming_the_field(tokenizer, chat_format):
    follow_up = {"role": "user", "content": "more"}
    engine = scripted(chat_format, "ok")
    with served(engine, chat_format) as client:
        out_of_vocab = completion(
            client, [*USER_ONLY, assistant_with_ids([1, 2], [3, 10**6]), follow_up]
        )
        not_int = completion(client, [*USER_ONLY, assistant_with_ids([1, "2"], [3]), follow_up])
        stream = completion(client, USER_ONLY, stream=True)
        several = completion(client, USER_ONLY, n=2)
        stop = completion(client, USER_ONLY, stop=["\n"])
        tool_without_id = completion(client, [*USER_ONLY, {"role": "tool", "content": "5"}])
        other_model = completion(client, USER_ONLY, model="gpt-4o")
        ignored_extras = completion(
            client, USER_ONLY, n=1, stream=False, metadata={"k": "v"}, user="u", temperature=None
        )
    assert out_of_vocab.status_code == 400
    assert out_of_vocab.json()["error"]["param"] == "messages[1].generation_token_ids"
    assert "messages[1].generation_token_ids[1] = 1000000" in error_message(out_of_vocab)
    assert not_int.status_code == 400
    assert "messages.1.prompt_token_ids.1" in error_message(not_int)
    assert stream.status_code == 400 and "stream=true is not supported" in error_message(stream)
    assert several.status_code == 400 and "n=2 is not supported" in error_message(several)
    assert stop.status_code == 400 and "stop" in error_message(stop)
    assert tool_without_id.status_code == 400 and "tool_call_id" in error_message(tool_without_id)
    assert other_model.status_code == 404 and MODEL in error_message(other_model)
    assert ignored_extras.status_code == 200
    assert engine.requests[-1].params.temperature == 1.0  # null means OpenAI's default
    assert len(engine.requests) == 1  # nothing rejected reached the engine


def test_context_limit_clamps_max_tokens_and_rejects_full_prompts(tokenizer, chat_format):
    engine = scripted(chat_format, "a fairly long answer that will be cut short by the limit")
    prompt_len = len(
        tokenizer.apply_chat_template(USER_ONLY, add_generation_prompt=True)["input_ids"]
    )
    with served(engine, chat_format, max_context_tokens=prompt_len + 4) as client:
        clamped = completion(client, USER_ONLY, max_tokens=50)
        too_long = completion(client, [{"role": "user", "content": "word " * 40}])
    assert clamped.status_code == 200, clamped.text
    assert engine.requests[0].params.max_new_tokens == 4
    choice = clamped.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["message"]["generation_token_ids"]) == 4
    assert too_long.status_code == 400
    # NeMo-Gym's vllm_model adapter turns a 400 mentioning "context length" into finish "length".
    assert f"maximum context length is {prompt_len + 4} tokens" in error_message(too_long)


def test_slow_engine_times_out_with_504(tokenizer, chat_format):
    engine = scripted(chat_format, "late", delay_s=0.6)
    with served(engine, chat_format, request_timeout_s=0.2) as client:
        response = completion(client, USER_ONLY)
    assert response.status_code == 504
    assert "request_timeout_s=0.2" in error_message(response)


def test_engine_failure_is_a_500_with_the_cause(tokenizer, chat_format):
    engine = scripted(chat_format, "x", fail_with="the device fell over")
    with served(engine, chat_format) as client:
        response = completion(client, USER_ONLY)
    assert response.status_code == 500
    assert "ValueError: the device fell over" in error_message(response)


def test_real_torch_engine_two_turns_stay_contiguous(tokenizer, chat_format):
    engine = _tiny_torch_engine(tokenizer, max_batch_size=4)
    with served(engine, chat_format, default_max_tokens=6) as client:
        first = completion(client, USER_ONLY, seed=1)
        assert first.status_code == 200, first.text
        second = completion(client, second_turn(first.json()), seed=2)
    assert second.status_code == 200, second.text
    message_1 = first.json()["choices"][0]["message"]
    message_2 = second.json()["choices"][0]["message"]
    for message in (message_1, message_2):
        assert len(message["generation_token_ids"]) == len(message["generation_log_probs"]) > 0
        assert all(logprob <= 0 for logprob in message["generation_log_probs"])
        assert message["weight_version"] == 0
    earlier = message_1["prompt_token_ids"] + message_1["generation_token_ids"]
    assert message_2["prompt_token_ids"][: len(earlier)] == earlier


def test_a_short_request_is_not_held_back_by_a_long_torch_generation(tokenizer, chat_format):
    """A short answer asked for while a long one is decoding joins the engine's rows at its
    next step and comes back before the long one ends (no batch waits for its slowest row)."""
    engine = _tiny_torch_engine(tokenizer, max_batch_size=4)
    steps = threading.Semaphore(0)
    hook = engine._model.base_model.register_forward_pre_hook(
        lambda *_args, **_kwargs: steps.release(), with_kwargs=True
    )
    try:
        with (
            served(engine, chat_format, request_timeout_s=120.0) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            long = pool.submit(completion, client, USER_ONLY, max_tokens=1500, seed=1)
            for _ in range(3):  # its prefill and two decode steps
                assert steps.acquire(timeout=30), "the long generation did not start"
            short = completion(client, [{"role": "user", "content": "later"}], max_tokens=3)
            assert short.status_code == 200, short.text
            assert not long.done(), "the short answer waited for the long generation"
            assert long.result().status_code == 200
    finally:
        hook.remove()
        engine.close()
    assert len(short.json()["choices"][0]["message"]["generation_token_ids"]) == 3


def test_a_fused_torch_engine_answers_past_its_cache_room_and_reports_a_failed_step(
    tokenizer, chat_format, monkeypatch
):
    """A reply of 200 tokens on the fused decode step (its cache grows past the room a batch
    reserves), then a step that fails: the request that hit it and every later one are 500
    naming the engine's error, and `GET /health` says the engine stopped (not 200)."""
    engine = _tiny_torch_engine(tokenizer, max_batch_size=2, decode_path="fused")
    health = "/health"
    with served(engine, chat_format, default_max_tokens=200, request_timeout_s=60.0) as client:
        long = completion(client, USER_ONLY, seed=1)
        assert long.status_code == 200, long.text
        assert len(long.json()["choices"][0]["message"]["generation_token_ids"]) == 200

        def broken_step(batch):
            raise RuntimeError("the device fell over")

        monkeypatch.setattr(engine, "_decode_step", broken_step)
        failed, later = completion(client, USER_ONLY), completion(client, USER_ONLY)
        probe = httpx.get(str(client.base_url.copy_with(path=health)))
    engine.close()
    for response in (failed, later):
        assert response.status_code == 500
        assert "RuntimeError: the device fell over" in error_message(response)
        assert "retry-after" not in response.headers
    assert probe.status_code == 503
    assert "torch engine stopped after a failed step" in error_message(probe)


def test_sglang_requests_are_not_held_back_by_a_long_generation(chat_format):
    """With SGLang each chat request is its own /generate: a short answer arriving after a long
    generation started comes back before that one ends (no batch waits for its slowest member)."""
    app, state = make_standin(context_length=4096, token_delay_s=0.01)
    with (
        serve_in_thread(app) as sglang,
        SGLangEngine([sglang.url], request_timeout_s=20.0, refit_timeout_s=20.0) as engine,
        served(engine, chat_format) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        started = time.monotonic()
        long = pool.submit(completion, client, USER_ONLY, max_tokens=300)
        deadline = time.monotonic() + 10
        while state.tokens_sampled == 0:
            assert time.monotonic() < deadline, "the long generation did not start"
            time.sleep(0.005)
        short = completion(client, [{"role": "user", "content": "later"}], max_tokens=3)
        short_done = time.monotonic() - started
        assert short.status_code == 200, short.text
        assert long.result().status_code == 200
        long_done = time.monotonic() - started
    assert len(short.json()["choices"][0]["message"]["generation_token_ids"]) == 3
    assert short_done < 0.5 * long_done  # the long one takes about 3 s
    assert [len(body["input_ids"]) > 0 for kind, body in state.events] == [True, True]


def test_a_seed_sglang_would_ignore_is_a_400_naming_seed_not_a_500(chat_format):
    """SGLang without deterministic inference ignores a request's seed: the policy server says
    so with a 400 naming `seed` (clients do not retry it), not a 500 an agent retries and
    charges to the failure budget; without a seed the same server answers."""
    app, state = make_standin(context_length=4096)
    with (
        serve_in_thread(app) as sglang,
        SGLangEngine([sglang.url], request_timeout_s=20.0, refit_timeout_s=20.0) as engine,
        served(engine, chat_format) as client,
    ):
        seeded = completion(client, USER_ONLY, max_tokens=3, seed=7)
        plain = completion(client, USER_ONLY, max_tokens=3)
    assert seeded.status_code == 400, seeded.text
    assert seeded.json()["error"]["param"] == "seed"
    assert "deterministic_inference=true" in error_message(seeded)
    assert plain.status_code == 200, plain.text
    assert len(state.events) == 1  # the seeded request never reached the server


def test_bodies_are_parsed_in_one_pass_and_refusals_name_the_field(tokenizer, chat_format):
    """Lone surrogates and broken JSON are refused by pydantic-core's parser, naming the field;
    a body past `OFF_LOOP_BODY_BYTES` (parsed on a worker thread) is answered like any other."""
    engine = scripted(chat_format, "ok")
    long_turns = [
        msg
        for turn in range(400)
        for msg in (
            {"role": "user", "content": f"question {turn}"},
            assistant_with_ids(list(range(300)), [5, 6]),
        )
    ]
    with served(engine, chat_format, honor_prompt_token_ids=False, max_context_tokens=10**6) as c:
        surrogate = c.post(
            "/chat/completions",
            content=b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            headers={"Content-Type": "application/json"},
        )
        not_json = c.post("/chat/completions", content=b'{"messages": [')
        large_body = json.dumps({"model": MODEL, "messages": [*long_turns, *USER_ONLY]}).encode()
        large = c.post("/chat/completions", content=large_body)
    assert surrogate.status_code == 400
    assert "messages.0.content: holds a lone UTF-16 surrogate" in error_message(surrogate)
    assert not_json.status_code == 400
    assert "body: Invalid JSON: EOF while parsing" in error_message(not_json)
    assert len(large_body) > OFF_LOOP_BODY_BYTES
    assert large.status_code == 200, large.text[:300]
    assert len(engine.requests) == 1


def test_health_needs_no_key_and_answers_while_serving(tokenizer, chat_format):
    with served(scripted(chat_format, "ok"), chat_format) as client:
        response = httpx.get(str(client.base_url.copy_with(path="/health")))  # no API key
    assert (response.status_code, response.content) == (200, b"")


def test_a_training_server_samples_every_request_at_the_runs_settings(chat_format):
    """Over HTTP: left-out fields and mismatches get the training settings (override), counted;
    under reject a mismatch is a 400 naming the field and never reaches the engine."""
    trained, greedy = Sampling(0.7, 0.9), Sampling(0.0, 1.0)
    engine = scripted(chat_format, "5.")
    overriding = SamplingParity(SamplingRules(trained, frozenset({greedy}), "override"))
    with served(engine, chat_format, sampling_parity=overriding) as client:
        left_out = completion(client, USER_ONLY)
        openai_default = completion(client, USER_ONLY, temperature=1.0, top_p=1.0)
        between_passes = completion(client, USER_ONLY, temperature=0.0)
        overriding.set_validating(True)
        validation = completion(client, USER_ONLY, temperature=0.0)
    answers = (left_out, openai_default, between_passes, validation)
    assert [r.status_code for r in answers] == [200] * 4
    sampled = [Sampling(r.params.temperature, r.params.top_p) for r in engine.requests]
    assert sampled == [trained, trained, trained, greedy]
    assert overriding.counts() == SamplingCounts(overridden=2, rejected=0)

    rejecting = SamplingParity(SamplingRules(trained, frozenset(), "reject"))
    with served(engine, chat_format, sampling_parity=rejecting) as client:
        refused = completion(client, USER_ONLY, temperature=0.7, top_p=1.0)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "top_p"
    assert "temperature=0.7, top_p=0.9" in error_message(refused)
    assert len(engine.requests) == 4
    assert rejecting.counts() == SamplingCounts(overridden=0, rejected=1)


def text_only_second_turn(first_answer: dict, *, user: str = USER_ONLY[0]["content"]) -> list:
    """The second turn as a client that keeps only text sends it (no token ids)."""
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": first_answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And 3 + 4?"},
    ]


@pytest.mark.parametrize("stop", [False, True])
def test_a_re_rendered_history_is_a_divergence_seen_at_once(tokenizer, chat_format, stop):
    """The engine's answer is not how the tokenizer encodes its text, so a client sending text
    only makes the server re-tokenise it into other ids: the request no longer extends what the
    server generated. Counted either way; with stop the server answers without generating."""
    engine = ScriptedEngine(char_level_reply(tokenizer, chat_format, "five is the sum"))
    watch = DivergenceWatch(capacity=64, stop=stop, marks_last_s=None)
    with served(engine, chat_format, divergence_watch=watch) as client:
        first = completion(client, USER_ONLY).json()
        second = completion(client, text_only_second_turn(first))
    assert second.status_code == 200, second.text
    assert watch.counts() == DivergenceCounts(detected=1, stopped=int(stop))
    choice = second.json()["choices"][0]
    message = choice["message"]
    rendered = tokenizer.apply_chat_template(
        text_only_second_turn(first), add_generation_prompt=True
    )["input_ids"]
    assert message["prompt_token_ids"] == rendered
    if stop:
        assert len(engine.requests) == 1  # nothing generated for the diverged request
        assert choice["finish_reason"] == "content_filter"
        assert message["content"] is None and message["tool_calls"] is None
        assert message["generation_token_ids"] == message["generation_log_probs"] == []
        assert second.json()["usage"]["completion_tokens"] == 0
    else:
        assert len(engine.requests) == 2
        assert message["generation_token_ids"] == engine.reply


def test_histories_with_their_ids_or_unknown_answers_are_generated_for(tokenizer, chat_format):
    """A client sending the ids back extends the history; an assistant turn the server never
    wrote (edited by the client) cannot be checked, and is not called a divergence."""
    engine = scripted(chat_format, "five")
    watch = DivergenceWatch(capacity=64, stop=True, marks_last_s=None)
    with served(engine, chat_format, divergence_watch=watch) as client:
        first = completion(client, USER_ONLY).json()
        with_ids = completion(client, second_turn(first))
        edited = text_only_second_turn(first)
        edited[1]["content"] = "5"
        unknown = completion(client, edited)
    for answer in (with_ids, unknown):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "stop"
    assert len(engine.requests) == 3
    assert watch.counts() == DivergenceCounts(unchecked=1)  # the edited turn
