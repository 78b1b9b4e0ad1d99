"""Serving an app on loopback: start, answer, stop, on the event loop and HTTP parser asked for;
shutdown cancellations are not errors."""

import asyncio
import logging
import socket
import time

import httpx
import pytest
from fastapi import FastAPI

from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.keep_alive import CLIENT_KEEPALIVE_EXPIRY_S, SERVER_KEEP_ALIVE_S
from nemo_gym_ext.retry import RETRY_AFTER_S


def test_serves_on_a_free_loopback_port_and_stops():
    app = FastAPI()

    @app.get("/ping")
    def ping():
        return {"ok": True}

    with serve_in_thread(app) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{server.url}/ping", timeout=5).json() == {"ok": True}
    try:
        httpx.get(f"{server.url}/ping", timeout=1)
        raise AssertionError("the server still answers after close()")
    except httpx.ConnectError:
        pass


def test_an_idle_connection_outlives_the_pools_of_common_clients():
    """uvicorn's own 5 s would close a connection that httpx (5 s) or aiohttp (15 s) may reuse
    at that moment, losing the request: ours stays open past both (nemo_gym_ext.keep_alive)."""
    app = FastAPI()

    @app.get("/ping")
    def ping():
        return {"ok": True}

    with (
        serve_in_thread(app) as server,
        socket.create_connection(
            ("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=5
        ) as connection,
    ):
        connection.sendall(b"GET /ping HTTP/1.1\r\nhost: test\r\n\r\n")
        assert b'{"ok":true}' in connection.recv(4096)
        time.sleep(6.0)  # past uvicorn's default keep-alive
        connection.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing to read: not closed (b"") by the server
            connection.recv(1, socket.MSG_PEEK)
    assert SERVER_KEEP_ALIVE_S > 15 > CLIENT_KEEPALIVE_EXPIRY_S


def test_requests_cancelled_by_shutdown_are_not_logged_as_errors():
    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    logger = logging.getLogger("uvicorn.error")  # uvicorn's own config stops propagation
    collect = Collect()
    logger.addHandler(collect)
    try:
        for error in (asyncio.CancelledError(), RuntimeError("a real failure")):
            try:
                raise error
            except BaseException:
                logger.exception("Exception in ASGI application")
        # Starlette's lifespan sends its failure as text, e.g. when cancelled at shutdown.
        logger.error(
            "Traceback (most recent call last):\n  ...\nasyncio.exceptions.CancelledError\n"
        )
        logger.error("Traceback (most recent call last):\n  ...\nValueError: broken startup")
    finally:
        logger.removeHandler(collect)
    real_failure, broken_startup = collect.records
    assert real_failure.exc_info[0] is RuntimeError
    assert broken_startup.getMessage().endswith("ValueError: broken startup")


async def _which_loop_and_parser(scope, receive, send) -> None:
    """A bare ASGI app answering with the modules of its event loop and of uvicorn's protocol
    (its `send` is a method of the protocol's request cycle; nothing between wraps it)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    loop = type(asyncio.get_running_loop()).__module__
    parser = type(send.__self__).__module__.rsplit(".", 1)[-1]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": f"{loop} {parser}".encode()})


@pytest.mark.parametrize(
    ("loop", "http", "expected"),
    [
        # What every server of the project gets: uvloop and httptools are its dependencies.
        ("auto", "auto", "uvloop httptools_impl"),
        # The load benchmark's baseline.
        ("asyncio", "h11", "asyncio.unix_events h11_impl"),
    ],
)
def test_the_server_runs_on_the_loop_and_parser_it_was_given(loop, http, expected):
    with serve_in_thread(_which_loop_and_parser, loop=loop, http=http) as server:
        assert httpx.get(server.url, timeout=5).text == expected


def _echo_app(delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict):
        await asyncio.sleep(delay_s)
        return {"keys": sorted(body)}

    return app


def test_bodies_over_the_limit_are_413_declared_or_chunked_and_the_server_keeps_serving():
    with serve_in_thread(_echo_app(), max_body_bytes=1000) as server:
        url = f"{server.url}/echo"
        small = httpx.post(url, json={"a": "x" * 100}, timeout=5)
        declared = httpx.post(url, json={"a": "x" * 5000}, timeout=5)

        def chunks():
            for _ in range(10):
                yield b"x" * 200

        chunked = httpx.post(url, content=chunks(), timeout=5)  # no Content-Length
        after = httpx.post(url, json={"b": 1}, timeout=5)
    assert small.status_code == 200 and small.json() == {"keys": ["a"]}
    assert (declared.status_code, chunked.status_code) == (413, 413)
    error = declared.json()["error"]
    assert error["param"] == "body" and "1000" in error["message"]
    assert after.json() == {"keys": ["b"]}


def test_requests_beyond_the_concurrency_limit_get_503_at_once():
    with serve_in_thread(_echo_app(delay_s=1.0), max_concurrency=3) as server:

        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=10) as client:
                answers = await asyncio.gather(
                    *(client.post(f"{server.url}/echo", json={"i": i}) for i in range(12))
                )
                again = await client.post(f"{server.url}/echo", json={"i": 0})
            waits = {answer.headers.get("retry-after") for answer in answers if answer.is_error}
            assert waits == {str(RETRY_AFTER_S)}, "every 503 says when to come back"
            return [answer.status_code for answer in answers] + [again.status_code]

        codes = asyncio.run(flood())
    # Three run (the 1 s handler holds them), the other nine are refused at once; then the
    # server serves again: the count went back down.
    assert sorted(codes[:-1]) == [200] * 3 + [503] * 9
    assert codes[-1] == 200
