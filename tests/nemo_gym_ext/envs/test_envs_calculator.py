"""The calculator environment: rows, its resources server, and whole episodes over HTTP."""

import httpx
import pytest

from nemo_gym_ext.envs.calculator import CALCULATOR
from nemo_gym_ext.envs.registry import make_rows
from nemo_gym_ext.envs.resources import make_resources_app
from nemo_gym_ext.envs.tools import evaluate_expression
from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.wire import Row
from tests.nemo_gym_ext.envs.scripted_policy_server import call, scripted, text


def row_with_answer(expected_answer: str) -> dict:
    return make_rows("calculator", 1, seed=0)[0] | {"expected_answer": expected_answer}


def test_a_correct_answer_after_a_tool_call_earns_reward_one(start_env, run):
    environment, _ = start_env(
        "calculator",
        scripted(call("calculator", {"expression": "(12 + 7) * 3"}), text("The answer is 57.")),
    )
    row = row_with_answer("57")
    result = run(environment, row)

    assert result["reward"] == 1.0
    assert result["num_turns"] == 2
    assert result["num_tool_calls"] == 1
    assert result["overlong"] is False
    tool_output = result["response"]["output"][1]
    assert tool_output["type"] == "function_call_output"
    assert tool_output["output"] == "57", "computed by the resources server, not scripted"
    for key, value in row.items():
        assert result[key] == value, f"row field {key} is echoed"


@pytest.mark.parametrize("answer", ["The answer is 58.", "57 is too hard", ""])
def test_a_wrong_or_missing_final_answer_earns_zero(start_env, run, answer):
    environment, _ = start_env(
        "calculator",
        scripted(call("calculator", {"expression": "57"}), text(answer)),
    )
    result = run(environment, row_with_answer("58" if answer == "57 is too hard" else "57"))
    assert result["reward"] == 0.0


@pytest.mark.parametrize(
    "answer, reward",
    [
        ("Answer: 57. Check: 57 = 50 + 7", 1.0),  # the announced answer counts, not later numbers
        ("19 * 3 = 57", 1.0),  # without an announcement, the last number
        ("57, or maybe 58", 0.0),  # listing candidates is not answering
        ("(12 + 7) * 3 = 57 because 12 + 7 = 19 and 19 times 3", 0.0),
        ("the answer is 56 or 57", 0.0),
    ],
)
def test_only_the_final_answer_counts_not_a_right_number_somewhere(start_env, run, answer, reward):
    environment, _ = start_env("calculator", scripted(text(answer)))
    result = run(environment, row_with_answer("57"))
    assert (result["reward"], result["answered"]) == (reward, True)


def test_an_episode_that_never_answers_stops_at_max_turns_with_zero(start_env, run):
    environment, policy = start_env(
        "calculator",
        scripted(*[call("calculator", {"expression": "57"})] * 3),
        max_turns=3,
    )
    result = run(environment, row_with_answer("57"))
    assert result["num_turns"] == 3
    assert len(policy.requests) == 3
    assert result["reward"] == 0.0, "the tool output is not the model's answer"


def test_rows_are_deterministic_valid_and_answer_their_question():
    rows = make_rows("calculator", 40, seed=7)
    assert rows == make_rows("calculator", 40, seed=7)
    assert rows != make_rows("calculator", 40, seed=8)
    assert len({row["question"] for row in rows}) > 20
    for row in rows:
        Row.model_validate(row)
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "calculator_agent"}
        assert row["responses_create_params"]["input"][-1]["content"] == row["question"]
        assert int(row["expected_answer"]) >= 0
        if row["question"].startswith("What is "):
            expression = row["question"].removeprefix("What is ").removesuffix("?")
            assert evaluate_expression(expression) == int(row["expected_answer"])


def test_resources_server_refuses_bad_rows_and_unknown_sessions():
    with serve_in_thread(make_resources_app(CALCULATOR)) as server:
        bad = httpx.post(f"{server.url}/seed_session", json={"question": "1+1?"}, timeout=10)
        assert bad.status_code == 422
        assert "expected_answer: Field required" in bad.json()["detail"]
        unknown = httpx.post(
            f"{server.url}/calculator", json={"session_id": "nope", "expression": "1"}, timeout=10
        )
        assert unknown.status_code == 404
        assert "unknown session_id 'nope'" in unknown.json()["detail"]
        seeded = httpx.post(f"{server.url}/seed_session", json=row_with_answer("2"), timeout=10)
        session_id = seeded.json()["session_id"]
        answer = httpx.post(
            f"{server.url}/calculator", json={"session_id": session_id, "expression": "1+1"},
            timeout=10,
        )  # fmt: skip
        assert answer.json() == {"output": "2", "done": False}
        verify = {"session_id": session_id, "response": {"output": []}}
        verified = httpx.post(f"{server.url}/verify", json=verify, timeout=10).json()
        assert verified == {"reward": 0.0, "answered": False}
        again = httpx.post(f"{server.url}/verify", json=verify, timeout=10)
        assert again.status_code == 404, "verify closes the session"
