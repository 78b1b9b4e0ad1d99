"""The built-in environments by name: their rows, and starting them on loopback.

`start_builtin_environment` starts an environment's resources server and an agent in front of it
as two real HTTP servers on 127.0.0.1, so rollout collection talks to a built-in environment
exactly as it talks to a NeMo-Gym deployment: by posting rows to `{agent_url}/run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_ext.envs.agent import AgentOptions, ToolAgent, make_agent_app
from nemo_gym_ext.envs.calculator import CALCULATOR
from nemo_gym_ext.envs.guess_number import GUESS_NUMBER
from nemo_gym_ext.envs.resources import EnvironmentSpec, make_resources_app
from nemo_gym_ext.http_server import LOOPBACK, RunningServer, serve_in_thread

ENVIRONMENTS: dict[str, EnvironmentSpec] = {spec.name: spec for spec in (CALCULATOR, GUESS_NUMBER)}


def get_environment(env_name: str) -> EnvironmentSpec:
    if env_name not in ENVIRONMENTS:
        raise ValueError(
            f"unknown built-in environment {env_name!r}; choose one of {sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[env_name]


def make_rows(
    env_name: str, num_rows: int, seed: int, *, agent_name: str | None = None
) -> list[dict[str, Any]]:
    """`num_rows` deterministic rows of `env_name`, routed to `agent_name` (default
    `<env_name>_agent`)."""
    return get_environment(env_name).make_rows(num_rows, seed, agent_name)


@dataclass
class BuiltinEnvironment:
    """A running built-in environment: post rows to `agent_url + "/run"`; `close()` stops it."""

    name: str
    env_name: str
    agent_url: str
    resources_url: str
    _servers: list[RunningServer] = field(repr=False)

    def close(self) -> None:
        """Stop the agent, then the resources server behind it."""
        while self._servers:
            self._servers.pop().close()

    def __enter__(self) -> BuiltinEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_builtin_environment(
    env_name: str,
    *,
    agent_name: str | None = None,
    policy_base_url: str,
    policy_api_key: str,
    options: AgentOptions | Mapping[str, Any] | None = None,
) -> BuiltinEnvironment:
    """Serve `env_name`'s resources server and its agent on loopback; returns once both accept.

    `policy_base_url` is the OpenAI base URL including `/v1` (the agent posts to
    `{policy_base_url}/chat/completions`). `options` are :class:`AgentOptions` or their fields.
    """
    spec = get_environment(env_name)
    agent_options = (
        options if isinstance(options, AgentOptions) else AgentOptions.model_validate(options or {})
    )
    name = agent_name or spec.default_agent_name
    # Loopback only, whatever the policy server does: the environments hold the answers (the
    # secret number, the verifier) and take no key; only the shard on this node calls them.
    resources = serve_in_thread(make_resources_app(spec), host=LOOPBACK)
    try:
        agent = ToolAgent(
            name=name,
            resources_url=resources.url,
            policy_base_url=policy_base_url,
            policy_api_key=policy_api_key,
            options=agent_options,
        )
        agent_server = serve_in_thread(make_agent_app(agent), host=LOOPBACK)
    except BaseException:
        resources.close()
        raise
    return BuiltinEnvironment(
        name=name,
        env_name=env_name,
        agent_url=agent_server.url,
        resources_url=resources.url,
        _servers=[resources, agent_server],
    )
