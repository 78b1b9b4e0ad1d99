"""A scripted policy server, for the environment tests only.

The server is a real FastAPI app on loopback speaking the policy-server wire format:
it returns full `ChatCompletion` bodies whose assistant message is scripted (text and/or tool
calls) and whose token bundle is computed with the real SmolLM2 tokenizer (the ChatML prompt of
the messages it received, the tokens of the scripted reply). It records every request, so tests
can check the wire format the agent sends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nemo_gym_ext.envs.registry import BuiltinEnvironment

API_KEY = "test-key"
LOGPROB = -0.25


@dataclass(frozen=True)
class Reply:
    """One scripted assistant reply: text and/or tool calls as (name, JSON-string arguments)."""

    content: str | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()
    finish_reason: str | None = None


Script = Callable[[dict[str, Any]], Reply]


@dataclass
class ScriptedPolicy:
    """Answers each request with `script(request_body)`; records bodies, headers and answers."""

    tokenizer: Any
    script: Script
    delay_s: float = 0.0
    busy_retry_after: str | None = None  # set: every request gets 503 with this Retry-After
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    _numbers: Iterator[int] = field(default_factory=itertools.count)

    async def answer(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse(status_code=401, content={"error": "bad key"})
        if self.busy_retry_after is not None:
            headers = {"Retry-After": self.busy_retry_after}
            return JSONResponse(status_code=503, content={"error": "busy"}, headers=headers)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        completion = self._completion(body, self.script(body), next(self._numbers))
        self.responses.append(completion)
        return JSONResponse(completion)

    def _completion(self, body: dict[str, Any], reply: Reply, number: int) -> dict[str, Any]:
        calls = [
            {"id": f"call_{number}_{index}", "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for index, (name, arguments) in enumerate(reply.tool_calls)
        ]  # fmt: skip
        prompt = self.tokenizer.apply_chat_template(
            [_as_text(message) for message in body["messages"]],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
        generated_text = (reply.content or "") + "".join(_tool_call_text(c) for c in calls)
        generation = self.tokenizer.encode(generated_text + "<|im_end|>", add_special_tokens=False)
        finish_reason = reply.finish_reason or ("tool_calls" if calls else "stop")
        return {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish_reason,
                    "logprobs": None,
                    "message": {
                        "role": "assistant",
                        "content": reply.content,
                        "tool_calls": calls or None,
                        "prompt_token_ids": prompt,
                        "generation_token_ids": generation,
                        "generation_log_probs": [LOGPROB] * len(generation),
                    },
                }
            ],
        }


class PolicyServer:
    """One server for a whole test session; each test installs its own :class:`ScriptedPolicy`.

    A request is answered by the policy installed when it arrived, so a slow request left over
    from one test never consumes the next test's script.
    """

    def __init__(self) -> None:
        self.policy: ScriptedPolicy | None = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> JSONResponse:
            assert self.policy is not None, "no scripted policy installed"
            return await self.policy.answer(request)

        return app


def _tool_call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    payload = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


def _as_text(message: dict[str, Any]) -> dict[str, str]:
    """A message the ChatML template can render: tool calls written out as text."""
    text = (message.get("content") or "") + "".join(
        _tool_call_text(call) for call in message.get("tool_calls") or []
    )
    return {"role": message["role"], "content": text}


def scripted(*replies: Reply) -> Script:
    """A script that answers with `replies` in order and fails the test if asked for more."""
    queue = list(replies)

    def script(body: dict[str, Any]) -> Reply:
        assert queue, f"the scripted policy ran out of replies at request with {body['messages']}"
        return queue.pop(0)

    return script


def text(content: str) -> Reply:
    return Reply(content=content)


def call(name: str, arguments: dict[str, Any] | str) -> Reply:
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return Reply(tool_calls=((name, encoded),))


def run_row(environment: BuiltinEnvironment, row: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{environment.agent_url}/run", json=row, timeout=30.0)
