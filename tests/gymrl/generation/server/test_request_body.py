"""The policy server's body bound (`gymrl.generation.server.request_body`) over real HTTP on
loopback: a body the context cannot hold is refused with 413 before it is read (by its
Content-Length) or as soon as the bytes read pass the bound (sent chunked), and a body that does
not arrive is refused at the request deadline. The clients are raw sockets, so a test can count
what was sent when the answer came: a server that reads the body first (as it did before issue
42, when a 30 MB body was read and tokenised for 41-45 s before the context check refused it)
answers nothing until the client sends it all."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.gymrl.generation.server.scripted_server import (
    KEY,
    MODEL,
    USER_ONLY,
    completion,
    scripted,
    served,
)

CONTEXT = 256
BOUND = CONTEXT * 1024  # served() sets request_bytes_per_context_token=1024
HUGE = 30_000_000  # the body
ANSWER_WITHIN_S = 5.0
PIECE = 64 * 1024


def _huge_body_prefix() -> bytes:
    """The start of a 30 MB chat request: one user message of text, its rest still to come."""
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]}).encode()[:-4]


def _headers(client: httpx.Client, framing: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {client.base_url.host}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n{framing}\r\n"
    ).encode()


@contextmanager
def _connected(client: httpx.Client) -> Iterator[socket.socket]:
    with socket.create_connection((client.base_url.host, client.base_url.port), timeout=10) as s:
        yield s


def _answer(sock: socket.socket, within_s: float) -> tuple[int, dict]:
    """The status and JSON body of the server's answer, read within `within_s`."""
    sock.settimeout(within_s)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return status, json.loads(rest[:length])


def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.fixture
def client(chat_format) -> Iterator[httpx.Client]:
    with served(scripted(chat_format, "5"), chat_format, max_context_tokens=CONTEXT) as client:
        yield client


def _serves(client: httpx.Client) -> None:
    response = completion(client, USER_ONLY)
    assert response.status_code == 200, response.text


def test_a_declared_length_over_the_contexts_bound_is_refused_before_the_body_is_sent(client):
    """The client declares 30 MB, sends 64 KiB of it and waits: the 413 comes at once. A server
    that reads the body before refusing it (every server before issue 42, whose only bound was
    64 MiB) waits for the other 29.9 MB and answers nothing."""
    with _connected(client) as sock:
        sock.sendall(_headers(client, f"Content-Length: {HUGE}\r\n"))
        sock.sendall(_huge_body_prefix().ljust(PIECE, b"x"))
        started = time.monotonic()
        status, answer = _answer(sock, ANSWER_WITHIN_S)
        waited = time.monotonic() - started
    assert status == 413, answer
    error = answer["error"]
    assert error["param"] == "body" and error["type"] == "invalid_request_error"
    message = error["message"]
    assert f"{HUGE} bytes declared by its Content-Length" in message
    assert f"{BOUND} bytes = its context of {CONTEXT} tokens" in message
    assert "generation.server.request_bytes_per_context_token=1024" in message
    assert waited < ANSWER_WITHIN_S
    _serves(client)


def test_a_chunked_body_is_refused_once_the_bytes_read_pass_the_bound(client):
    """Sent chunked (no Content-Length), the body is read only until it passes the bound: the
    413 comes while the client still has most of its 30 MB to send."""
    sent = 0
    with _connected(client) as sock:
        sock.sendall(_headers(client, "Transfer-Encoding: chunked\r\n"))
        piece = _huge_body_prefix().ljust(PIECE, b"x")
        while sent < HUGE and not _answered(sock):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
            piece = b"x" * PIECE
            time.sleep(0.001)  # a client that streams, as a slow network would
        status, answer = _answer(sock, ANSWER_WITHIN_S)
    assert status == 413, answer
    assert "read so far (sent without Content-Length)" in answer["error"]["message"]
    # What loopback's socket buffers hold on top of the bound, not the 30 MB.
    assert BOUND < sent < HUGE / 3, sent
    _serves(client)


def test_a_body_under_the_bound_is_answered_and_one_over_it_is_a_413_as_an_agent_sees_it(
    client,
):
    """Through httpx, as Gym's agents post: the whole body is sent, and the answer read is the
    413 naming the key (the server discards the rest of the body, keeping the connection)."""
    near = completion(client, [{"role": "user", "content": "x " * (BOUND // 8)}])
    assert near.status_code == 400, near.text  # read and rendered: the context check answers
    assert "maximum context length" in near.json()["error"]["message"]
    over = completion(client, [{"role": "user", "content": "x " * BOUND}])
    assert over.status_code == 413, over.text
    assert "request_bytes_per_context_token" in over.json()["error"]["message"]
    _serves(client)


def test_a_body_that_does_not_arrive_is_refused_at_the_request_deadline(chat_format):
    """Reading waits on the client, so it has the request's deadline: a client that declares a
    body and sends a few bytes of it gets 408 naming the key, and the server goes on."""
    with (
        served(scripted(chat_format, "5"), chat_format, request_timeout_s=1.0) as client,
        _connected(client) as sock,
    ):
        sock.sendall(_headers(client, "Content-Length: 1000\r\n") + b'{"model"')
        started = time.monotonic()
        status, answer = _answer(sock, ANSWER_WITHIN_S)
        waited = time.monotonic() - started
        assert status == 408, answer
        assert "generation.server.request_timeout_s=1.0 s" in answer["error"]["message"]
        assert 0.9 < waited < ANSWER_WITHIN_S
        _serves(client)
