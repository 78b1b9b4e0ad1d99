"""The agent loop shared by the built-in environments, served as a NeMo-Gym agent (`POST /run`).

One episode: seed a session on the environment's resources server, then alternate model calls and
environment steps until the environment says it is done, `max_turns` model calls have been made,
a call stops at the token limit (`finish_reason == "length"`, the result is marked
`overlong`; with `continue_after_length` the episode goes on), or the server withholds the answer
(`finish_reason == "content_filter"`: with `generation.server.stop_on_divergence` it answers so
when the episode's history no longer matches what it generated). Then `/verify` scores it.

Each model call is a `POST {policy_base_url}/chat/completions` in the shape NeMo-Gym's
`vllm_model` adapter uses for training: non-streaming, bearer key, the row's
sampling parameters, always `logprobs: true, top_logprobs: 0, return_tokens_as_token_ids: true`,
and - with `send_token_ids` - every earlier assistant turn carrying the exact tokens it was
sampled as, so the server can keep them instead of re-tokenising text. With
`send_token_ids=false` the agent behaves like an external harness that only keeps text, and the
server's re-tokenisation may break contiguity (what `truncate_noncontiguous_episodes` is for).

After a call with tool calls, each call is executed on the resources server and its output
appended; arguments the model got wrong (bad JSON, wrong types, an unknown tool) become an error
output the model can read, never a failed episode. After a call without tool calls, the
environment's `/user_turn` decides whether to follow up with a user message or end.

The result is the row's fields, `response.output`, `/verify`'s fields as they are (the reward is
checked where a result enters the recipe, by the postprocessor, as for any Gym agent's result),
the turn counts and each model call's `finish_reason` (`finish_reasons`, which an eval records).

Failures that are not the model's (the policy or resources server unreachable, slow, or
answering garbage) fail the `/run` request with 502/504 and a message naming the server, the URL
and the option to change; the rollout collector retries those. A 503 from either server (it is
busy or shutting down) is passed on as a 503 with that server's `Retry-After`, so the collector
waits as long before it tries again. Bodies go out and come in through orjson: a late model call
of a long episode carries every earlier turn's token ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_ext.http_server import refuse_invalid_requests_safely
from nemo_gym_ext.json_body import JSON_HEADERS, dumps_json
from nemo_gym_ext.keep_alive import CLIENT_KEEPALIVE_EXPIRY_S
from nemo_gym_ext.retry import RETRY_AFTER_S, retry_after_s
from nemo_gym_ext.wire import (
    WITHHELD_FINISH_REASON,
    ChatCompletion,
    Row,
    chat_tools,
    completion_to_items,
    function_call_output_item,
    item_text,
    items_to_chat_messages,
    user_message_item,
)


class AgentOptions(BaseModel):
    """Options of the built-in agent: an agent entry's `options` under `env.nemo_gym.agents`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(
        default=8,
        ge=1,
        description="Most model calls per episode; the episode is verified as it stands after.",
    )
    send_token_ids: bool = Field(
        default=True,
        description="Send earlier assistant turns back with their prompt/generation token ids and "
        "log-probabilities (on-policy prefix). False sends text and tool calls only, as an "
        "external harness does, so the server re-tokenises and contiguity can break.",
    )
    request_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Timeout of every HTTP call the agent makes (policy and resources servers). "
        "Generous by default: on a CPU engine a model call may queue behind a whole batch.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Generation limit per model call, used when the row has no "
        "responses_create_params.max_output_tokens; None sends no limit.",
    )
    continue_after_length: bool = Field(
        default=False,
        description="Treat a reply cut at the token limit like any other reply (the environment "
        "answers it) instead of ending the episode there. NeMo-Gym's agents end the episode; "
        "smoke runs of an untrained model, which rarely emits an end of turn, turn this on so "
        "that episodes still reach several turns. The result is marked `overlong` either way.",
    )
    policy_model: str = Field(
        default="policy", description="The `model` field sent to the policy server."
    )


class AgentError(RuntimeError):
    """A failure that is not the model's; `status_code` is what `/run` answers (502 or 504, or
    503 with the `Retry-After` of a server behind that asked to be called later)."""

    def __init__(self, message: str, *, status_code: int = 502, retry_after: float | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.retry_after = retry_after


class ContextFullError(AgentError):
    """The policy server refused a model call: the conversation leaves no room in its context."""


class ToolAgent:
    """Runs episodes of one environment against one policy server."""

    def __init__(
        self,
        *,
        name: str,
        resources_url: str,
        policy_base_url: str,
        policy_api_key: str,
        options: AgentOptions,
    ):
        self.name = name
        self.resources_url = resources_url.rstrip("/")
        self.policy_base_url = policy_base_url.rstrip("/")
        self.options = options
        self._headers = {"Authorization": f"Bearer {policy_api_key}"}

    async def run(self, client: httpx.AsyncClient, raw_row: dict[str, Any]) -> dict[str, Any]:
        """One episode of `raw_row`; returns the Gym result (row fields echoed, output, reward)."""
        try:
            row = Row.model_validate(raw_row)
            tools = chat_tools(row.responses_create_params.tools)
            items_to_chat_messages(row.responses_create_params.input, include_token_ids=False)
        except ValueError as error:  # pydantic's ValidationError is a ValueError
            raise AgentError(f"not a valid Gym row: {error}", status_code=422) from error
        tool_names = sorted(tool["function"]["name"] for tool in tools)
        seeded = await self._post(client, "/seed_session", raw_row)
        session_id = _field(seeded, "session_id", str, "/seed_session")
        output: list[dict[str, Any]] = []
        num_turns = num_tool_calls = 0
        overlong = done = False
        finish_reasons: list[str] = []
        while not done and num_turns < self.options.max_turns:
            try:
                completion = await self._complete(client, row, tools, output)
            except ContextFullError:
                # As Gym's vllm_model adapter does: the episode ends at the context limit. On
                # the first call the collector names the row's prompt as too long.
                overlong = True
                finish_reasons.append("length")
                break
            num_turns += 1
            items, finish_reason = completion_to_items(completion)
            finish_reasons.append(finish_reason)
            output.extend(items)
            if finish_reason == WITHHELD_FINISH_REASON:
                break
            if finish_reason == "length":
                overlong = True
                if not self.options.continue_after_length:
                    break
            calls = [item for item in items if item["type"] == "function_call"]
            for call in calls:
                num_tool_calls += 1
                tool_output, done = await self._call_tool(client, session_id, call, tool_names)
                output.append(function_call_output_item(call["call_id"], tool_output))
                if done:
                    break
            if not calls:
                text = "".join(item_text(item) for item in items if item["type"] == "message")
                reply = await self._post(
                    client, "/user_turn", {"session_id": session_id, "text": text}
                )
                content = _field(reply, "content", str | None, "/user_turn")
                if content is not None:
                    output.append(user_message_item(content))
                done = _field(reply, "done", bool, "/user_turn")
        verified = await self._post(
            client, "/verify", {"session_id": session_id, "response": {"output": output}}
        )
        return {
            **raw_row,
            "response": {"output": output},
            **verified,
            "num_turns": num_turns,
            "num_tool_calls": num_tool_calls,
            "overlong": overlong,
            "finish_reasons": finish_reasons,
        }

    async def _complete(
        self,
        client: httpx.AsyncClient,
        row: Row,
        tools: list[dict[str, Any]],
        output: list[dict[str, Any]],
    ) -> ChatCompletion:
        params = row.responses_create_params
        body: dict[str, Any] = {
            "model": self.options.policy_model,
            "messages": items_to_chat_messages(
                [*params.input, *output], include_token_ids=self.options.send_token_ids
            ),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": True,
            "top_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if tools:
            body["tools"] = tools
        max_tokens = params.max_output_tokens or self.options.max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if params.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = params.parallel_tool_calls
        url = f"{self.policy_base_url}/chat/completions"
        answer = await self._request(client, "policy server", url, body, self._headers)
        try:
            return ChatCompletion.model_validate(answer)
        except ValidationError as error:
            raise AgentError(
                f"policy server at {url} returned an invalid ChatCompletion: "
                f"{error.errors(include_url=False)[:3]}"
            ) from error

    async def _call_tool(
        self,
        client: httpx.AsyncClient,
        session_id: str,
        call: dict[str, Any],
        tool_names: list[str],
    ) -> tuple[str, bool]:
        """(output, done) of one tool call; the model's own mistakes come back as error outputs."""
        name = call["name"]
        if name not in tool_names:
            return f"Error: unknown tool {name!r}; available tools: {', '.join(tool_names)}", False
        try:
            arguments = json.loads(call["arguments"])
        except json.JSONDecodeError as error:
            return (
                f"Error: the arguments of {name} are not valid JSON ({error.msg} at character "
                f"{error.pos}); send a JSON object",
                False,
            )
        if not isinstance(arguments, dict):
            return (
                f"Error: the arguments of {name} must be a JSON object, got "
                f"{type(arguments).__name__}",
                False,
            )
        reply = await self._post(client, f"/{name}", {**arguments, "session_id": session_id})
        return _field(reply, "output", str, f"/{name}"), _field(reply, "done", bool, f"/{name}")

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict) -> dict[str, Any]:
        return await self._request(
            client, "resources server", f"{self.resources_url}{path}", body, headers=None
        )

    async def _request(
        self,
        client: httpx.AsyncClient,
        what: str,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str] | None,
    ) -> dict[str, Any]:
        timeout = self.options.request_timeout_s
        try:
            response = await client.post(
                url,
                content=dumps_json(body),
                headers={**JSON_HEADERS, **(headers or {})},
                timeout=timeout,
            )
        except httpx.TimeoutException as error:
            raise AgentError(
                f"{what} at {url} did not answer within {timeout} s "
                f"({type(error).__name__}); raise the agent option request_timeout_s if it is "
                "just slow",
                status_code=504,
            ) from error
        except httpx.HTTPError as error:
            raise AgentError(f"{what} at {url} could not be reached: {error!r}") from error
        if response.status_code == 503:  # "call later": passed on, so the collector waits
            raise AgentError(
                f"{what} at {url} answered HTTP 503: {response.text[:500]}",
                status_code=503,
                retry_after=retry_after_s(response.headers),
            )
        if response.status_code == 400 and "maximum context length" in response.text:
            raise ContextFullError(f"{what} at {url} refused the call: {response.text[:500]}")
        if response.status_code != 200:
            raise AgentError(
                f"{what} at {url} answered HTTP {response.status_code}: {response.text[:500]}"
            )
        try:
            answer = orjson.loads(response.content)
        except ValueError as error:
            raise AgentError(
                f"{what} at {url} answered non-JSON: {response.text[:200]!r}"
            ) from error
        if not isinstance(answer, dict):
            raise AgentError(f"{what} at {url} answered {type(answer).__name__}, not an object")
        return answer


def _field(answer: dict[str, Any], key: str, kind: Any, route: str) -> Any:
    """`answer[key]` if it is a `kind`; otherwise the resources server broke its contract."""
    if key not in answer or not isinstance(answer[key], kind):
        raise AgentError(
            f"resources server {route} answered {str(answer)[:200]}: field {key!r} should be {kind}"
        )
    return answer[key]


def make_agent_app(agent: ToolAgent) -> FastAPI:
    """The agent's HTTP server: `POST /run` takes a row and returns its result."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Many episodes run at once; httpx's default pool (100 connections) would make the
        # excess wait for a free connection, so the bound here is only a safety net.
        limits = httpx.Limits(
            max_connections=1024,
            max_keepalive_connections=256,
            keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
        )
        # Every call passes this deadline itself too (`_request`); here it also covers any other.
        timeout = agent.options.request_timeout_s
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            app.state.client = client
            yield

    app = FastAPI(title=f"{agent.name} agent", lifespan=lifespan)
    refuse_invalid_requests_safely(app)

    @app.exception_handler(AgentError)
    async def agent_error(request: Request, error: AgentError) -> JSONResponse:
        headers = None
        if error.status_code == 503:
            wait = RETRY_AFTER_S if error.retry_after is None else math.ceil(error.retry_after)
            headers = {"Retry-After": str(wait)}
        return JSONResponse(
            status_code=error.status_code, content={"detail": str(error)}, headers=headers
        )

    @app.post("/run")
    async def run(request: Request, row: dict[str, Any]) -> Response:
        result = await agent.run(request.app.state.client, row)
        return Response(dumps_json(result), media_type="application/json")

    return app
