"""Property-based fuzzing of the built-in environments' routes (hypothesis), over real HTTP.

Resources servers (`/seed_session`, each tool, `/user_turn`, `/verify`) and the agent's `/run`
get arbitrary JSON, hostile values inside otherwise valid requests of a live session, and
pathological bodies. A request may be answered (a tool's bad arguments are the model's mistake:
a 200 whose output says so) or refused with a 4xx that says what is wrong; never a 5xx, and the
servers keep serving.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_gym_ext.envs.agent import AgentOptions, ToolAgent, make_agent_app
from nemo_gym_ext.envs.registry import ENVIRONMENTS, make_rows
from nemo_gym_ext.envs.resources import make_resources_app
from nemo_gym_ext.http_server import serve_in_thread
from tests.support.hostile_json import JSON_VALUES, PATHOLOGICAL_BODIES, encode

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ENV_NAMES = sorted(ENVIRONMENTS)


@pytest.fixture(scope="module")
def servers():
    """Every environment's resources server, and one agent whose policy URL is a closed port
    (a row valid enough to reach the policy is not what these tests send)."""
    running = {
        name: serve_in_thread(make_resources_app(spec)) for name, spec in ENVIRONMENTS.items()
    }
    agent = ToolAgent(
        name="calculator_agent",
        resources_url=running["calculator"].url,
        policy_base_url="http://127.0.0.1:9/v1",
        policy_api_key="unused",
        options=AgentOptions(),
    )
    running["agent"] = serve_in_thread(make_agent_app(agent))
    clients = {
        name: httpx.Client(base_url=server.url, timeout=30) for name, server in running.items()
    }
    yield clients
    for name, server in running.items():
        clients[name].close()
        server.close()


def _routes(env_name: str) -> list[str]:
    spec = ENVIRONMENTS[env_name]
    return ["/seed_session", *(f"/{tool.name}" for tool in spec.tools), "/user_turn", "/verify"]


ROUTES = [(env, route) for env in ENV_NAMES for route in _routes(env)]


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert response.json()["detail"] or response.json()["error"]


def _session(client: httpx.Client, env_name: str) -> str:
    row = make_rows(env_name, 1, seed=0)[0]
    response = client.post("/seed_session", json=row)
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


@FUZZ
@given(where=st.sampled_from(ROUTES), body=JSON_VALUES)
def test_arbitrary_json_on_any_resources_route(servers, where, body):
    env_name, route = where
    _check(servers[env_name].post(route, content=encode(body)))


@FUZZ
@given(
    env_name=st.sampled_from(ENV_NAMES), fields=st.dictionaries(st.text(max_size=8), JSON_VALUES)
)
def test_hostile_fields_in_a_live_session(servers, env_name, fields):
    """A real session, then every route with the session id and hostile fields around it."""
    client = servers[env_name]
    for route in _routes(env_name)[1:]:
        session_id = _session(client, env_name)
        _check(client.post(route, content=encode({**fields, "session_id": session_id})))


@FUZZ
@given(env_name=st.sampled_from(ENV_NAMES), output=JSON_VALUES, text=JSON_VALUES)
def test_hostile_episode_output_and_text_in_a_live_session(servers, env_name, output, text):
    client = servers[env_name]
    turn = {"session_id": _session(client, env_name), "text": text}
    _check(client.post("/user_turn", content=encode(turn)))
    for episode in (
        output,
        [output],
        [{"type": "message", "role": "assistant", "content": output}],
    ):
        verify = {"session_id": _session(client, env_name), "response": {"output": episode}}
        _check(client.post("/verify", content=encode(verify)))


@FUZZ
@given(body=JSON_VALUES)
def test_arbitrary_json_on_the_agents_run(servers, body):
    _check(servers["agent"].post("/run", content=encode(body)))


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL_BODIES))
def test_pathological_bodies_everywhere_and_the_servers_keep_serving(servers, name):
    for env_name, route in ROUTES:
        _check(servers[env_name].post(route, content=PATHOLOGICAL_BODIES[name]))
    _check(servers["agent"].post("/run", content=PATHOLOGICAL_BODIES[name]))
    for env_name in ENV_NAMES:
        _session(servers[env_name], env_name)
