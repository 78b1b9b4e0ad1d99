"""The guess_number environment: multi-turn episodes over HTTP."""

import json
import re

from nemo_gym_ext.envs.registry import make_rows
from nemo_gym_ext.wire import Row
from tests.nemo_gym_ext.envs.scripted_policy_server import Reply, call, scripted, text


def guess_row(secret: int, low: int = 1, high: int = 8) -> dict:
    return make_rows("guess_number", 1, seed=0)[0] | {"secret": secret, "low": low, "high": high}


def binary_search(body: dict) -> Reply:
    """A policy that follows the hints: it reads its earlier guesses and their answers."""
    low, high = 1, 8
    pending = {}
    for message in _episode(body):
        for tool_call in message.get("tool_calls") or []:
            pending[tool_call["id"]] = json.loads(tool_call["function"]["arguments"])["number"]
        if message["role"] == "tool":
            guessed = pending[message["tool_call_id"]]
            if message["content"] == "higher":
                low = guessed + 1
            elif message["content"] == "lower":
                high = guessed - 1
    return call("guess", {"number": (low + high) // 2})


def test_a_model_that_never_guesses_is_prompted_every_turn_until_max_turns(start_env, run):
    environment, policy = start_env(
        "guess_number", lambda body: text("I like turtles."), max_turns=5
    )
    result = run(environment, guess_row(secret=3))

    assert result["num_turns"] == 5
    assert len(policy.requests) == 5
    assert result["reward"] == 0.0
    assert result["num_guesses"] == 0
    for body in policy.requests[1:]:
        assert body["messages"][-1]["role"] == "user"
        assert body["messages"][-1]["content"].startswith("Please guess a number between 1 and 8")
    follow_ups = [item for item in result["response"]["output"] if item.get("role") == "user"]
    assert len(follow_ups) == 5


def test_binary_search_with_the_tool_finds_the_number(start_env, run):
    environment, _ = start_env("guess_number", binary_search, max_turns=8)
    for secret in (1, 6, 8):
        result = run(environment, guess_row(secret))
        outputs = [
            item["output"] for item in result["response"]["output"]
            if item["type"] == "function_call_output"
        ]  # fmt: skip
        assert result["reward"] == 1.0
        assert outputs[-1] == "correct"
        assert set(outputs[:-1]) <= {"higher", "lower"}
        assert result["num_guesses"] == result["num_tool_calls"] <= 4
        assert result["num_turns"] == result["num_tool_calls"], "the episode ends at 'correct'"


def test_integers_in_plain_text_count_as_guesses(start_env, run):
    environment, policy = start_env(
        "guess_number",
        scripted(text("My guess is 4."), text("Maybe 12?"), text("Then 6"), text("5!")),
    )
    result = run(environment, guess_row(secret=5))

    assert result["reward"] == 1.0
    assert result["num_guesses"] == 4
    assert result["num_turns"] == 4
    feedback = [body["messages"][-1]["content"] for body in policy.requests[1:]]
    assert feedback == [
        "4: higher. Guess again.",
        "12: 12 is out of range: the number is between 1 and 8. Guess again.",
        "6: lower. Guess again.",
    ]
    assert result["response"]["output"][-1]["role"] == "assistant", "no follow-up after a win"


def test_a_search_that_does_not_find_the_number_earns_half_the_share_it_ruled_out(start_env, run):
    # [1, 9] has 8 wrong candidates; secret 7.
    environment, _ = start_env("guess_number", scripted(call("guess", {"number": 5})), max_turns=1)
    result = run(environment, guess_row(secret=7, low=1, high=9))
    # "higher" leaves [6, 9]: 3 wrong candidates left, 5 of 8 ruled out.
    assert (result["reward"], result["candidates_left"]) == (0.5 * 5 / 8, 4)

    environment, _ = start_env(
        "guess_number", scripted(call("guess", {"number": 5}), text("8")), max_turns=2
    )
    result = run(environment, guess_row(secret=7, low=1, high=9))
    assert (result["reward"], result["candidates_left"]) == (0.5 * 7 / 8, 2)  # [6, 7]


def test_guesses_outside_the_range_and_replies_without_one_rule_out_nothing(start_env, run):
    environment, _ = start_env(
        "guess_number", scripted(text("0"), text("no idea"), text("50")), max_turns=3
    )
    result = run(environment, guess_row(secret=3))
    assert result["reward"] == 0.0
    assert result["candidates_left"] == 8
    assert result["num_guesses"] == 2


def test_following_the_hints_earns_more_than_repeating_a_guess(start_env, run):
    rows = make_rows("guess_number", 12, seed=1)
    searcher, _ = start_env("guess_number", binary_search_from_prompt, max_turns=2)
    searched = [run(searcher, row)["reward"] for row in rows]
    repeater, _ = start_env("guess_number", same_guess_from_prompt, max_turns=2)
    repeated = [run(repeater, row)["reward"] for row in rows]
    assert all(r > 0.0 for r in repeated)
    assert sum(searched) > sum(repeated)


def _episode(body: dict) -> list[dict]:
    """The messages from the task's prompt on (the rows' example game comes before it)."""
    messages = body["messages"]
    starts = [i for i, m in enumerate(messages) if m["content"] and "thinking of" in m["content"]]
    return messages[starts[-1] :]


def _range_of(body: dict) -> tuple[int, int]:
    match = re.search(r"between (\d+) and (\d+)", _episode(body)[0]["content"])
    assert match, "the task prompt names its range"
    return int(match[1]), int(match[2])


def binary_search_from_prompt(body: dict) -> Reply:
    low, high = _range_of(body)
    for message in _episode(body)[1:]:
        if message["role"] == "user" and ":" in message["content"]:
            guessed, verdict = message["content"].split(":")[:2]
            if "higher" in verdict:
                low = int(guessed) + 1
            elif "lower" in verdict:
                high = int(guessed) - 1
    return text(str((low + high) // 2))


def same_guess_from_prompt(body: dict) -> Reply:
    low, high = _range_of(body)
    return text(str((low + high) // 2))


def test_rows_are_deterministic_and_valid():
    rows = make_rows("guess_number", 20, seed=3, agent_name="guesser")
    assert rows == make_rows("guess_number", 20, seed=3, agent_name="guesser")
    for row in rows:
        Row.model_validate(row)
        assert row["agent_ref"]["name"] == "guesser"
        assert row["low"] <= row["secret"] <= row["high"] <= 100 + 15
        assert 8 <= row["high"] - row["low"] + 1 <= 16
        assert (
            f"between {row['low']} and {row['high']}"
            in row["responses_create_params"]["input"][-1]["content"]
        )
        (tool,) = row["responses_create_params"]["tools"]
        assert tool["name"] == "guess"
        assert tool["parameters"]["properties"]["number"]["type"] == "integer"
    assert len({row["secret"] for row in rows}) > 3


def test_rows_show_a_won_game_with_the_tool_outside_every_sampled_range():
    """The example teaches the tool and the hints; copying its numbers must earn nothing."""
    rows = make_rows("guess_number", 50, seed=4)
    system, *example, prompt = rows[0]["responses_create_params"]["input"]
    assert (system["role"], prompt["role"]) == ("system", "user")
    assert example[0]["role"] == "user"
    calls = [item for item in example if item.get("type") == "function_call"]
    outputs = [item["output"] for item in example if item.get("type") == "function_call_output"]
    assert {call["name"] for call in calls} == {"guess"}
    assert outputs[-1] == "correct" and {"higher", "lower"} <= set(outputs[:-1])
    guesses = {json.loads(call["arguments"])["number"] for call in calls}
    for row in rows:
        assert row["responses_create_params"]["input"][1:-1] == example
        assert not any(row["low"] <= guess <= row["high"] for guess in guesses)
