"""The policy server on loopback in front of a scripted engine, and the client calls the server's
tests make: shared by the tests of its HTTP surface, of the template families through it, and of
its withheld answer read by Gym's own code.

A scripted engine is a real `GenerationEngine` that answers every request with a fixed token
sequence: the server's job is rendering, parsing and batching, and a script lets a test choose the
exact generated tokens (tool calls, non-canonical tokenisations, length cut-offs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

import httpx
import torch
from pydantic import SecretStr

from gymrl.generation.server.app import create_policy_server_app
from gymrl.generation.server.chat_template import ChatFormat
from gymrl.generation.types import EngineFailedError, GenerationOutput, GenerationRequest
from nemo_gym_ext.http_server import serve_in_thread

MODEL = "smollm2-policy"
KEY = "test-key"
USER_ONLY = [{"role": "user", "content": "What is 2 + 3?"}]


class ScriptedEngine:
    """Answers every request with `reply` (cut at `max_new_tokens`), after `delay_s`, on a
    thread of its own (a `RequestScheduler`, as both real engines are).

    Records each request, so tests can check what the server sent. Log-probabilities are
    deterministic negative numbers, one per token.
    """

    def __init__(self, reply: Sequence[int], *, delay_s: float = 0.0, fail_with: str | None = None):
        self.reply = list(reply)
        self.delay_s = delay_s
        self.fail_with = fail_with
        self.requests: list[GenerationRequest] = []
        self._version = 7
        self._lock = threading.Lock()

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._version = version

    def failure(self) -> EngineFailedError | None:
        return None

    def submit(self, request: GenerationRequest) -> Future[GenerationOutput]:
        with self._lock:
            self.requests.append(request)
        future: Future[GenerationOutput] = Future()
        threading.Thread(target=self._run, args=(request, future), daemon=True).start()
        return future

    def _run(self, request: GenerationRequest, future: Future[GenerationOutput]) -> None:
        time.sleep(self.delay_s)
        if not future.set_running_or_notify_cancel():
            return
        if self.fail_with is not None:
            future.set_exception(ValueError(self.fail_with))
        else:
            future.set_result(self._answer(request))

    def _answer(self, request: GenerationRequest) -> GenerationOutput:
        params = request.params
        ids = self.reply[: params.max_new_tokens]
        stopped = any(token in params.stop_token_ids for token in ids)
        return GenerationOutput(
            token_ids=ids,
            logprobs=[-0.25 * (1 + i % 4) for i in range(len(ids))],
            finish_reason="stop" if stopped else "length",
            weight_version=self._version,
            prompt_token_ids=list(request.prompt_token_ids),
        )


def scripted(chat_format: ChatFormat, text: str, **kwargs) -> ScriptedEngine:
    return ScriptedEngine([*chat_format.encode(text), chat_format.end_of_turn_id], **kwargs)


@contextmanager
def served(engine, chat_format, **overrides) -> Iterator[httpx.Client]:
    settings = {
        "model_name": MODEL,
        "api_key": SecretStr(KEY),
        "honor_prompt_token_ids": True,
        "default_max_tokens": 64,
        "max_context_tokens": 4096,
        "request_timeout_s": 10.0,
        "request_bytes_per_context_token": 1024,
        "render_timeout_s": 10.0,
    }
    settings.update(overrides)
    app = create_policy_server_app(engine, chat_format, **settings)
    with (
        serve_in_thread(app, max_body_bytes=None) as server,  # as GenerationServer serves it
        httpx.Client(
            base_url=f"{server.url}/v1",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=settings["request_timeout_s"] + 10.0,
        ) as client,
    ):
        yield client


def completion(client: httpx.Client, messages, **fields) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": messages,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        **fields,
    }
    return client.post("/chat/completions", json=body)


def char_level_reply(tokenizer, chat_format, text: str) -> list[int]:
    """`text` one byte-level token per character (not how the tokenizer would encode it)."""
    ids = tokenizer.convert_tokens_to_ids([("Ġ" if c == " " else c) for c in text])
    assert ids != chat_format.encode(text)
    return [*ids, chat_format.end_of_turn_id]
