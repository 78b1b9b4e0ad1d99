"""Fixtures of the SGLang engine's tests."""

from __future__ import annotations

import pytest

from nemo_gym_ext.http_server import serve_in_thread
from tests.support.sglang_standin import make_standin


@pytest.fixture
def standin():
    """Start stand-in servers on demand (`start(**make_standin's options) -> (url, state)`); all
    are closed at the end of the test."""
    started = []

    def start(**kwargs):
        app, state = make_standin(**kwargs)
        server = serve_in_thread(app)
        started.append(server)
        return server.url, state

    yield start
    for server in started:
        server.close()
