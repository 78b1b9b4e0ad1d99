"""The shared agent loop against a scripted policy server, over real HTTP on loopback."""

import pytest

from nemo_gym_ext.config import NemoGymPostprocessConfig
from nemo_gym_ext.envs.registry import make_rows
from nemo_gym_ext.postprocess import postprocess_gym_result
from nemo_gym_ext.wire import TOKEN_FIELDS, items_to_chat_messages
from tests.nemo_gym_ext.envs.scripted_policy_server import (
    API_KEY,
    LOGPROB,
    Reply,
    call,
    run_row,
    scripted,
    text,
)


def calculator_row(**create_params) -> dict:
    row = make_rows("calculator", 1, seed=0)[0]
    row["responses_create_params"].update(create_params)
    return row


def test_requests_follow_the_vllm_model_training_wire_contract(start_env, run):
    environment, policy = start_env(
        "calculator", scripted(call("calculator", {"expression": "2 + 3"}), text("It is 5."))
    )
    row = calculator_row(max_output_tokens=48, parallel_tool_calls=False)
    run(environment, row)

    assert len(policy.requests) == 2
    for body, headers in zip(policy.requests, policy.headers, strict=True):
        assert headers["authorization"] == f"Bearer {API_KEY}"
        assert body["model"] == "policy"
        assert body["logprobs"] is True
        assert body["top_logprobs"] == 0
        assert body["return_tokens_as_token_ids"] is True
        assert body["temperature"] == 1.0
        assert body["top_p"] == 1.0
        assert body["max_tokens"] == 48
        assert body["parallel_tool_calls"] is False
        assert not body.get("stream", False)
        (tool,) = body["tools"]
        assert tool["type"] == "function"
        assert set(tool["function"]) == {"name", "description", "parameters"}
        assert tool["function"]["name"] == "calculator"
        assert tool["function"]["parameters"]["required"] == ["expression"]

    first, second = (body["messages"] for body in policy.requests)
    # The row's input (system prompt, the worked example's items, the task) as chat messages.
    prompt = items_to_chat_messages(
        row["responses_create_params"]["input"], include_token_ids=False
    )
    assert first == prompt
    assert second[: len(prompt)] == prompt
    assert [m["role"] for m in second[len(prompt) :]] == ["assistant", "tool"]
    assistant, tool_message = second[len(prompt) :]
    assert assistant["content"] is None, "a tool-call-only turn is sent with content null"
    (tool_call,) = assistant["tool_calls"]
    assert tool_call == {
        "id": "call_0_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'},
    }
    sent_back = {name: assistant[name] for name in TOKEN_FIELDS}
    returned = policy.responses[0]["choices"][0]["message"]
    assert sent_back == {name: returned[name] for name in TOKEN_FIELDS}
    assert tool_message == {"role": "tool", "tool_call_id": "call_0_0", "content": "5"}


def test_without_send_token_ids_earlier_turns_are_sent_as_text_only(start_env, run):
    environment, policy = start_env(
        "guess_number",
        scripted(text("4"), call("guess", {"number": 2}), text("I give up")),
        send_token_ids=False,
        max_turns=3,
        max_tokens=32,
    )
    row = make_rows("guess_number", 1, seed=0)[0] | {"secret": 1, "low": 1, "high": 8}
    run(environment, row)

    last = policy.requests[-1]
    assert last["max_tokens"] == 32, "the agent option applies when the row sets no limit"
    prompt = items_to_chat_messages(
        row["responses_create_params"]["input"], include_token_ids=False
    )
    episode = last["messages"][len(prompt) :]  # after the row's input (with its example game)
    assistants = [m for m in episode if m["role"] == "assistant"]
    assert [m["content"] for m in assistants] == ["4", None]
    for message in last["messages"]:
        assert not set(TOKEN_FIELDS) & set(message)


def test_token_fields_sit_on_the_last_item_of_each_model_call(start_env, run, tokenizer):
    text_and_call = Reply(content="Let me use the tool.", tool_calls=(("guess", '{"number": 4}'),))
    environment, policy = start_env(
        "guess_number", scripted(text_and_call, call("guess", {"number": 6}), text("7"))
    )
    row = make_rows("guess_number", 1, seed=0)[0] | {"secret": 7, "low": 1, "high": 8}
    result = run(environment, row)

    output = result["response"]["output"]
    assert [item["type"] for item in output] == [
        "message", "function_call", "function_call_output",
        "function_call", "function_call_output",
        "message",
    ]  # fmt: skip
    carriers = [index for index, item in enumerate(output) if "generation_token_ids" in item]
    assert carriers == [1, 3, 5]
    for index, response in zip(carriers, policy.responses, strict=True):
        message = response["choices"][0]["message"]
        for name in TOKEN_FIELDS:
            assert output[index][name] == message[name]
    assert output[5]["generation_log_probs"] == [LOGPROB] * len(output[5]["generation_token_ids"])
    assert tokenizer.decode(output[5]["generation_token_ids"]) == "7<|im_end|>"
    assert result["num_turns"] == 3
    assert result["num_tool_calls"] == 2


def test_malformed_tool_arguments_come_back_as_error_outputs(start_env, run):
    environment, _ = start_env(
        "calculator",
        scripted(
            call("calculator", '{"expression": "2 +'),
            call("calculator", {"expression": 5}),
            call("calculator", {"expr": "5"}),
            call("calculator", "[1, 2]"),
            call("web_search", {"query": "5"}),
            call("calculator", {"expression": "import os"}),
            text("5"),
        ),
    )
    row = calculator_row() | {"expected_answer": "5"}
    result = run(environment, row)

    errors = [
        item["output"] for item in result["response"]["output"]
        if item["type"] == "function_call_output"
    ]  # fmt: skip
    assert len(errors) == 6
    assert errors[0].startswith("Error: the arguments of calculator are not valid JSON")
    assert errors[1].startswith("Error: invalid arguments for calculator: expression:")
    assert "Call it as calculator(expression: string)" in errors[1]
    assert "expr: Extra inputs are not permitted" in errors[2]
    assert errors[3] == "Error: the arguments of calculator must be a JSON object, got list"
    assert errors[4] == "Error: unknown tool 'web_search'; available tools: calculator"
    assert errors[5].startswith("Error: cannot parse 'import os'")
    assert result["reward"] == 1.0
    assert result["num_tool_calls"] == 6


def test_a_generation_cut_at_the_token_limit_ends_the_episode_as_overlong(start_env, run):
    environment, policy = start_env(
        "guess_number", scripted(Reply(content="I think the number", finish_reason="length"))
    )
    result = run(environment, make_rows("guess_number", 1, seed=0)[0])
    assert result["overlong"] is True
    assert result["num_turns"] == 1
    assert result["reward"] == 0.0
    assert len(policy.requests) == 1


def test_continue_after_length_lets_the_environment_answer_cut_replies(start_env, run):
    environment, policy = start_env(
        "guess_number",
        scripted(*[Reply(content="I think the number", finish_reason="length")] * 3),
        continue_after_length=True,
        max_turns=3,
    )
    result = run(environment, make_rows("guess_number", 1, seed=0)[0])
    assert result["overlong"] is True
    assert result["num_turns"] == 3
    assert len(policy.requests) == 3
    user_turns = [i for i in result["response"]["output"] if i.get("role") == "user"]
    assert len(user_turns) == 3, "the environment answered every cut reply"


def test_a_withheld_answer_ends_the_episode_even_where_cut_replies_do_not(start_env, run):
    """The policy server answers a diverged request with `content_filter` under
    generation.server.stop_on_divergence: the episode ends there, and it is not overlong."""
    environment, policy = start_env(
        "guess_number",
        scripted(*[Reply(content="", finish_reason="content_filter")] * 3),
        continue_after_length=True,
        max_turns=3,
    )
    result = run(environment, make_rows("guess_number", 1, seed=0)[0])
    assert len(policy.requests) == 1
    assert result["num_turns"] == 1
    assert result["finish_reasons"] == ["content_filter"]
    assert result["overlong"] is False


def test_a_slow_policy_server_fails_the_run_with_a_clear_timeout(start_env):
    environment, _ = start_env(
        "calculator", scripted(text("5")), delay_s=1.0, request_timeout_s=0.2
    )
    response = run_row(environment, calculator_row())
    assert response.status_code == 504
    detail = response.json()["detail"]
    assert "policy server at http://127.0.0.1:" in detail
    assert "/v1/chat/completions did not answer within 0.2 s" in detail
    assert "request_timeout_s" in detail


def test_a_rejected_policy_call_fails_the_run_naming_the_server(start_env):
    environment, _ = start_env("calculator", scripted(text("5")), policy_api_key="wrong-key")
    response = run_row(environment, calculator_row())
    assert response.status_code == 502
    detail = response.json()["detail"]
    assert "policy server at http://127.0.0.1:" in detail
    assert "answered HTTP 401" in detail


@pytest.mark.parametrize(("upstream", "passed_on"), [("7", "7"), ("2.5", "3"), ("soon", "1")])
def test_a_busy_policy_server_is_a_503_passing_on_its_retry_after(start_env, upstream, passed_on):
    """The collector then waits as long as the policy server asked (an unreadable value: the
    project's own `RETRY_AFTER_S`)."""
    environment, policy = start_env("calculator", scripted())
    policy.busy_retry_after = upstream
    response = run_row(environment, calculator_row())
    assert response.status_code == 503
    assert response.headers["retry-after"] == passed_on
    assert "policy server at http://127.0.0.1:" in response.json()["detail"]


def test_an_invalid_row_is_refused_with_the_field_named(start_env):
    environment, policy = start_env("calculator", scripted())
    response = run_row(environment, calculator_row() | {"responses_create_params": {"input": []}})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "not a valid Gym row" in detail
    assert "responses_create_params.input" in detail
    assert policy.requests == []


def test_results_are_training_data_for_the_postprocessor(start_env, run):
    environment, _ = start_env(
        "guess_number",
        scripted(call("guess", {"number": 4}), text("2"), call("guess", {"number": 3})),
    )
    row = make_rows("guess_number", 1, seed=0)[0] | {"secret": 3, "low": 1, "high": 8}
    result = run(environment, row)

    processed = postprocess_gym_result(row, result, NemoGymPostprocessConfig())
    assistant_turns = [entry for entry in processed.message_log if entry["role"] == "assistant"]
    assert len(assistant_turns) == result["num_turns"]
    assert processed.full_result["reward"] == 1.0
