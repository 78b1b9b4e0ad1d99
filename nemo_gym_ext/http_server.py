"""Serve an ASGI app on loopback in a background thread, with a bounded start and stop.

The model server and the built-in environments are real HTTP servers on 127.0.0.1 (random free
port), so the same code talks to them as to a remote NeMo-Gym deployment.

Every server gets two limits, so that one client (or a bug in one) cannot take a server down:
a largest request body (413 above it) and a number of requests in progress at once (503 with
`Retry-After` above it), both in :class:`RequestLimits`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from nemo_gym_ext.keep_alive import SERVER_KEEP_ALIVE_S
from nemo_gym_ext.retry import RETRY_AFTER_S

LOOPBACK = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONCURRENCY = 1024
_MAX_REPORTED_ERRORS = 5
_MAX_REPORTED_VALUE_CHARS = 80


class _DropCancelledRequests(logging.Filter):
    """Work cancelled because its server is shutting down is not an application error, yet
    uvicorn logs each cancelled request with a full traceback, and Starlette's lifespan reports
    its own cancellation as a traceback text ending in CancelledError."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            return False
        text = record.getMessage().rstrip()
        return not (text.startswith("Traceback") and text.endswith("CancelledError"))


logging.getLogger("uvicorn.error").addFilter(_DropCancelledRequests())


@dataclass
class RunningServer:
    url: str
    _server: uvicorn.Server
    _thread: threading.Thread

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully; connections still open after half the deadline are cut."""
        self._server.should_exit = True
        self._thread.join(timeout_s / 2)
        self._server.force_exit = True
        self._thread.join(timeout_s / 2)
        if self._thread.is_alive():
            raise TimeoutError(f"server at {self.url} did not stop within {timeout_s} s")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """FastAPI's validation errors as one line: `field: problem (got value)` for the first few.

    Values are shown only when short scalars: the input may be anything a client sent (bytes
    that are not UTF-8, megabytes of text), which must neither break the answer nor bloat it.
    """
    problems = []
    for detail in errors[:_MAX_REPORTED_ERRORS]:
        location = ".".join(str(part) for part in detail["loc"] if part != "body") or "body"
        value = detail.get("input")
        shown = ""
        if (
            isinstance(value, str | int | float | bool)
            and len(repr(value)) <= _MAX_REPORTED_VALUE_CHARS
        ):
            shown = f" (got {value!r})"
        problems.append(f"{location}: {detail['msg']}{shown}")
    more = len(errors) - _MAX_REPORTED_ERRORS
    suffix = f"; and {more} more" if more > 0 else ""
    return "invalid request: " + "; ".join(problems) + suffix


def refuse_invalid_requests_safely(app: FastAPI) -> None:
    """Answer a request that fails validation with a 422 `{"detail": "<one line>"}`.

    FastAPI's default handler echoes the raw input back, and fails with a 500 when that input is
    bytes that are not UTF-8."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_validation_errors(error.errors())}, 422)


class RequestLimits:
    """ASGI middleware: 413 for a body over `max_body_bytes`, 503 beyond `max_concurrency`
    requests in progress at once.

    A declared `Content-Length` above the limit is refused before a byte is read; a chunked body
    is read up to the limit and then refused. The app behind reads whole bodies anyway (FastAPI
    parses JSON at once), so buffering here costs no more memory than it would.
    `max_body_bytes=None` leaves bodies to an app that bounds them itself: they pass through
    unread, since buffering here would read a whole body before the app could refuse it by its
    length (the policy server's bound depends on its context,
    `gymrl.generation.server.request_body`). Requests, not
    connections, are counted: agents keep many idle keep-alive connections open, which cost
    nothing (uvicorn's own `limit_concurrency` counts those too and would refuse them).
    """

    def __init__(self, app, *, max_body_bytes: int | None, max_concurrency: int):
        for name, value in (
            ("max_body_bytes", max_body_bytes),
            ("max_concurrency", max_concurrency),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_concurrency = max_concurrency
        self.in_progress = 0  # touched only on the server's event loop

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.max_concurrency:
            await _refuse(
                send,
                503,
                f"server busy: {self.max_concurrency} requests are in progress, the most it serves "
                "at once; retry later",
                param=None,
            )
            return
        self.in_progress += 1
        try:
            if self.max_body_bytes is None:
                await self.app(scope, receive, send)
            else:
                await self._limit_body(scope, receive, send, self.max_body_bytes)
        finally:
            self.in_progress -= 1

    async def _limit_body(self, scope, receive, send, max_body_bytes: int) -> None:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_body_bytes:
            await self._too_large(send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_body_bytes:
                await self._too_large(send, size)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: int) -> None:
        message = (
            f"request body: {size} bytes is more than this server accepts "
            f"({self.max_body_bytes}); send a smaller request or raise the server's body limit"
        )
        await _refuse(send, 413, message, param="body")


async def _refuse(send, status: int, message: str, *, param: str | None) -> None:
    """An OpenAI-shaped error answer; the connection is closed after it."""
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    if status >= 500:
        error["type"] = "service_unavailable_error"
        headers += [(b"retry-after", str(RETRY_AFTER_S).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


def serve_in_thread(
    app,
    *,
    host: str = LOOPBACK,
    port: int = 0,
    start_timeout_s: float = 30.0,
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    loop: str = "auto",
    http: str = "auto",
):
    """Start `app` with uvicorn on `host:port` (0 = a free port) and return once it accepts.

    Bodies above `max_body_bytes` get 413 (None: the app bounds its own); beyond `max_concurrency`
    requests in progress, 503 (:class:`RequestLimits`). `loop` and `http` are uvicorn's: "auto"
    takes uvloop's event loop and httptools' parser, dependencies of this project, where they
    import (asyncio's and h11 otherwise); the load benchmark names them to measure one against
    the other. Idle connections are kept `SERVER_KEEP_ALIVE_S` (:mod:`nemo_gym_ext.keep_alive`)."""
    limited = RequestLimits(app, max_body_bytes=max_body_bytes, max_concurrency=max_concurrency)
    config = uvicorn.Config(
        limited,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        loop=loop,
        http=http,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,  # outlives the clients' pools (keep_alive.py)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{host}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"server on {host}:{port} exited during start-up (port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"server on {host}:{port} did not start within {start_timeout_s} s")
        time.sleep(0.01)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(url=f"http://{host}:{bound_port}", _server=server, _thread=thread)
