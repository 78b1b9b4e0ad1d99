"""Fixtures of the environment tests: the SmolLM2 tokenizer and running environments.

The scripted policy server itself lives in `scripted_policy_server.py` (a unique module name, so
test files can import its helpers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nemo_gym_ext.envs.registry import BuiltinEnvironment, start_builtin_environment
from nemo_gym_ext.http_server import serve_in_thread
from tests.nemo_gym_ext.envs.scripted_policy_server import (
    API_KEY,
    PolicyServer,
    Script,
    ScriptedPolicy,
    run_row,
)


@pytest.fixture(scope="session")
def policy_server() -> Iterator[tuple[PolicyServer, str]]:
    server = PolicyServer()
    with serve_in_thread(server.app()) as running:
        yield server, f"{running.url}/v1"


@pytest.fixture(scope="session")
def environments() -> Iterator[dict[tuple, BuiltinEnvironment]]:
    """Running environments, shared by the tests that use the same settings (starting and
    stopping two servers per test would dominate the test time)."""
    running: dict[tuple, BuiltinEnvironment] = {}
    yield running
    for environment in running.values():
        environment.close()


@pytest.fixture
def start_env(tokenizer, policy_server, environments) -> Callable[..., tuple]:
    """`start_env(env_name, script, delay_s=, policy_api_key=, **agent_options)` -> (env, policy).

    Installs a fresh scripted policy; the policy server accepts only the key `API_KEY`.
    """
    server, base_url = policy_server

    def start(
        env_name: str,
        script: Script,
        *,
        delay_s: float = 0.0,
        policy_api_key: str = API_KEY,
        **options: Any,
    ) -> tuple[BuiltinEnvironment, ScriptedPolicy]:
        policy = ScriptedPolicy(tokenizer, script, delay_s=delay_s)
        server.policy = policy
        key = (env_name, policy_api_key, tuple(sorted(options.items())))
        if key not in environments:
            environments[key] = start_builtin_environment(
                env_name, policy_base_url=base_url, policy_api_key=policy_api_key, options=options
            )
        return environments[key], policy

    return start


@pytest.fixture
def run() -> Callable[[BuiltinEnvironment, dict[str, Any]], dict[str, Any]]:
    """`run(environment, row)` -> the result of a successful `/run`."""

    def run_ok(environment: BuiltinEnvironment, row: dict[str, Any]) -> dict[str, Any]:
        response = run_row(environment, row)
        assert response.status_code == 200, response.text
        return response.json()

    return run_ok
