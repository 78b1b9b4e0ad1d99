"""Built-in environments by name: rows, options, and the lifetime of a started environment."""

import httpx
import pytest
from pydantic import ValidationError

from nemo_gym_ext.envs.agent import AgentOptions
from nemo_gym_ext.envs.registry import ENVIRONMENTS, make_rows, start_builtin_environment
from tests.nemo_gym_ext.envs.scripted_policy_server import (
    API_KEY,
    ScriptedPolicy,
    run_row,
    scripted,
    text,
)


def test_both_environments_are_registered_with_distinct_tools():
    assert set(ENVIRONMENTS) == {"calculator", "guess_number"}
    tool_names = {spec.name: [tool.name for tool in spec.tools] for spec in ENVIRONMENTS.values()}
    assert tool_names == {"calculator": ["calculator"], "guess_number": ["guess"]}


def test_unknown_environments_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown built-in environment 'chess'.*'calculator'"):
        make_rows("chess", 1, seed=0)
    with pytest.raises(ValueError, match="unknown built-in environment 'chess'"):
        start_builtin_environment("chess", policy_base_url="http://x/v1", policy_api_key="k")


def test_option_typos_are_refused_before_anything_starts():
    with pytest.raises(ValidationError, match="max_turn"):
        start_builtin_environment(
            "calculator",
            policy_base_url="http://x/v1",
            policy_api_key="k",
            options={"max_turn": 3},
        )
    for name, field in AgentOptions.model_fields.items():
        assert field.description, f"AgentOptions.{name} needs a description"


def test_a_started_environment_serves_runs_until_closed(policy_server, tokenizer):
    server, base_url = policy_server
    server.policy = ScriptedPolicy(tokenizer, scripted(text("5")))
    row = make_rows("calculator", 1, seed=0, agent_name="math")[0]
    with start_builtin_environment(
        "calculator",
        agent_name="math",
        policy_base_url=base_url,
        policy_api_key=API_KEY,
        options=AgentOptions(max_turns=1),
    ) as environment:
        assert environment.name == "math"
        assert environment.env_name == "calculator"
        # They hold the answers and take no key: loopback only, on a cluster too.
        assert environment.agent_url.startswith("http://127.0.0.1:")
        assert environment.resources_url.startswith("http://127.0.0.1:")
        result = run_row(environment, row).json()
        assert result["agent_ref"]["name"] == "math"
        assert result["num_turns"] == 1
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{environment.agent_url}/run", json=row, timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"{environment.resources_url}/seed_session", json=row, timeout=5)
