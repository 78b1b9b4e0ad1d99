"""Serve an ASGI app on loopback in a background thread, with a bounded start and stop.

The model server and the built-in environments are real HTTP servers on 127.0.0.1 (random free
port), so the same code talks to them as to a remote NeMo-Gym deployment.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import uvicorn


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


def serve_in_thread(app, *, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0):
    """Start `app` with uvicorn on `host:port` (0 = a free port) and return once it accepts."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
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
