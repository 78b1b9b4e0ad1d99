"""What a built-in environment is, and the resources server that serves one over HTTP.

An environment is an :class:`EnvironmentSpec`: its task fields, its tools, what it says when the
model replies with text instead of a tool call, how it scores an episode, and how it samples
tasks into rows. :func:`make_resources_app` serves any spec in the NeMo-Gym resources-server
shape, so each environment module holds only its own rules:

* `POST /seed_session` takes the row (its task fields; other fields are ignored) and returns
  `{"session_id"}`.
* `POST /<tool>` takes `{"session_id", ...arguments}` and returns `{"output", "done"}`. Arguments
  of the wrong shape are the model's mistake, not the server's: they produce an error *output*
  the model can read and correct, with status 200.
* `POST /user_turn` takes `{"session_id", "text"}` (an assistant reply without a tool call) and
  returns `{"content", "done"}`: the environment's user follow-up (`null` for none) and whether the
  episode is over.
* `POST /verify` takes `{"session_id", "response": {"output": [...]}}`, returns `{"reward", ...}`
  (numeric verifier fields) and closes the session.

Sessions live in memory, bounded: when `max_sessions` are open the oldest is dropped, so
episodes abandoned by a crashed agent cannot grow the server without limit.
"""

from __future__ import annotations

import random
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_ext.http_server import refuse_invalid_requests_safely
from nemo_gym_ext.wire import AGENT_REF_TYPE

State = TypeVar("State")
VerifierFields = dict[str, float | int | bool]


@dataclass(frozen=True)
class ToolReply:
    """A tool's answer: the text the model reads, and whether the episode is now over."""

    output: str
    done: bool = False


@dataclass(frozen=True)
class UserReply:
    """The environment's answer to a text reply: a user message (or None) and whether it is over."""

    content: str | None
    done: bool


@dataclass(frozen=True)
class Tool(Generic[State]):
    """One function tool. `arguments` is a pydantic model (extra="forbid") of its parameters."""

    name: str
    description: str
    arguments: type[BaseModel]
    call: Callable[[State, Any], ToolReply]

    def responses_schema(self) -> dict[str, Any]:
        """The tool as a Responses API function tool, parameters from the arguments model."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": _without_titles(self.arguments.model_json_schema()),
            "strict": True,
        }

    def signature(self) -> str:
        properties = self.arguments.model_json_schema()["properties"]
        params = ", ".join(f"{name}: {spec['type']}" for name, spec in properties.items())
        return f"{self.name}({params})"


@dataclass(frozen=True)
class SampledTask:
    """One sampled task: the user prompt and the task fields stored on the row."""

    prompt: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class EnvironmentSpec(Generic[State]):
    """Everything that makes one environment; served by :func:`make_resources_app`."""

    name: str
    system_prompt: str
    task: type[BaseModel]
    start: Callable[[Any], State]
    tools: tuple[Tool[State], ...]
    reply_to_text: Callable[[State, str], UserReply]
    verify: Callable[[State, list[dict[str, Any]]], VerifierFields]
    sample_task: Callable[[random.Random], SampledTask]
    # A solved episode (Responses items, starting with its user prompt) placed in every row's
    # input between the system prompt and the task: a small model shown one game played with the
    # tool plays the next one with it, where the tool's JSON schema alone makes it copy the schema.
    example: tuple[dict[str, Any], ...] = ()

    @property
    def default_agent_name(self) -> str:
        return f"{self.name}_agent"

    def make_rows(self, num_rows: int, seed: int, agent_name: str | None = None) -> list[dict]:
        """`num_rows` rows drawn with `random.Random(seed)`: the same seed gives the same rows."""
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        rng = random.Random(seed)
        tools = [tool.responses_schema() for tool in self.tools]
        rows = []
        for index in range(num_rows):
            task = self.sample_task(rng)
            rows.append(
                {
                    "id": f"{self.name}-{seed}-{index}",
                    "responses_create_params": {
                        "input": [
                            {"role": "system", "content": self.system_prompt},
                            *self.example,
                            {"role": "user", "content": task.prompt},
                        ],
                        "tools": tools,
                        "temperature": 1.0,
                        "top_p": 1.0,
                    },
                    "agent_ref": {
                        "type": AGENT_REF_TYPE,
                        "name": agent_name or self.default_agent_name,
                    },
                    **task.fields,
                }
            )
        return rows


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str


class UserTurnRequest(SessionRequest):
    text: str = Field(description="The assistant's reply, which had no tool call.")


class VerifyRequest(SessionRequest):
    response: dict[str, Any] = Field(description="`{output: [...items]}` of the episode.")


class _Sessions(Generic[State]):
    """Open sessions, oldest first; the oldest is dropped when `capacity` is reached."""

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._states: OrderedDict[str, State] = OrderedDict()

    def open(self, state: State) -> str:
        while len(self._states) >= self._capacity:
            self._states.popitem(last=False)
        session_id = uuid.uuid4().hex
        self._states[session_id] = state
        return session_id

    def get(self, session_id: Any) -> State:
        if session_id not in self._states:
            raise HTTPException(
                status_code=404,
                detail=f"unknown session_id {session_id!r}: seed one with POST /seed_session "
                f"(a session closes at /verify, and the oldest is dropped beyond "
                f"{self._capacity} open sessions)",
            )
        return self._states[session_id]

    def close(self, session_id: str) -> State:
        state = self.get(session_id)
        del self._states[session_id]
        return state


def make_resources_app(spec: EnvironmentSpec, *, max_sessions: int = 4096) -> FastAPI:
    """A FastAPI resources server for `spec` (routes in the module docstring)."""
    app = FastAPI(title=f"{spec.name} resources server")
    refuse_invalid_requests_safely(app)
    sessions: _Sessions = _Sessions(max_sessions)

    @app.post("/seed_session")
    async def seed_session(row: dict[str, Any]) -> dict[str, str]:
        try:
            task = spec.task.model_validate(row)
        except ValidationError as error:
            raise HTTPException(
                status_code=422,
                detail=f"row is not a {spec.name} task: {_describe(error)}",
            ) from error
        return {"session_id": sessions.open(spec.start(task))}

    for tool in spec.tools:
        app.add_api_route(f"/{tool.name}", _tool_endpoint(tool, sessions), methods=["POST"])

    @app.post("/user_turn")
    async def user_turn(request: UserTurnRequest) -> dict[str, Any]:
        reply = spec.reply_to_text(sessions.get(request.session_id), request.text)
        return {"content": reply.content, "done": reply.done}

    @app.post("/verify")
    async def verify(request: VerifyRequest) -> VerifierFields:
        output = request.response.get("output")
        if not isinstance(output, list):
            raise HTTPException(
                status_code=422, detail="response.output must be the list of the episode's items"
            )
        return spec.verify(sessions.close(request.session_id), output)

    return app


def _tool_endpoint(tool: Tool, sessions: _Sessions) -> Callable:
    async def call_tool(body: dict[str, Any]) -> dict[str, Any]:
        state = sessions.get(body.get("session_id"))
        raw = {key: value for key, value in body.items() if key != "session_id"}
        try:
            arguments = tool.arguments.model_validate(raw)
        except ValidationError as error:
            output = (
                f"Error: invalid arguments for {tool.name}: {_describe(error)}. "
                f"Call it as {tool.signature()}."
            )
            return {"output": output, "done": False}
        reply = tool.call(state, arguments)
        return {"output": reply.output, "done": reply.done}

    call_tool.__name__ = f"call_{tool.name}"
    return call_tool


def _describe(error: ValidationError, limit: int = 3) -> str:
    """The first few problems of a validation error, each with its field and the offending value."""
    problems = []
    for problem in error.errors()[:limit]:
        where = ".".join(str(part) for part in problem["loc"]) or "arguments"
        problems.append(f"{where}: {problem['msg']} (got {_short(problem['input'])})")
    return "; ".join(problems)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _without_titles(schema: Any) -> Any:
    """A JSON schema without pydantic's `title` annotations, which only lengthen the prompt.

    Only string-valued `title` keys go: a property *named* "title" maps to a schema and stays.
    """
    if isinstance(schema, dict):
        return {
            key: _without_titles(value)
            for key, value in schema.items()
            if not (key == "title" and isinstance(value, str))
        }
    if isinstance(schema, list):
        return [_without_titles(value) for value in schema]
    return schema
