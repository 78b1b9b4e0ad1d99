"""Serving an app on loopback: start, answer, stop; shutdown cancellations are not errors."""

import asyncio
import logging

import httpx
from fastapi import FastAPI

from nemo_gym_ext.http_server import serve_in_thread


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
