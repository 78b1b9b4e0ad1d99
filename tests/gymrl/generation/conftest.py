"""Fixtures shared by the generation tests."""

from __future__ import annotations

import pytest

from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin


@pytest.fixture
def standins():
    """`start(count, **standin_options)` -> [(url, state)]: loopback SGLang stand-ins, closed
    when the test ends."""
    started = []

    def start(count: int, **kwargs):
        result = []
        for _ in range(count):
            app, state = make_standin(**kwargs)
            server = serve_in_thread(app)
            started.append(server)
            result.append((server.url, state))
        return result

    yield start
    for server in started:
        server.close()
