"""The policy server's one render worker with a deadline on every call
(`gymrl.generation.server.render_worker`): alone, with calls that block until released, and
behind the real server over loopback, where a real slow render (megabytes of text for SmolLM2's
tokenizer) meets it. Before issue 42 a render had no deadline: the slow request was answered
when its render ended, and every request behind it waited as long."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gymrl.generation.server.api_error import ApiError
from gymrl.generation.server.render_worker import RenderWorker
from tests.gymrl.generation.server.scripted_server import USER_ONLY, completion, scripted, served

RELEASE_S = 10.0  # a blocked call ends by itself after this, so no test can hang on one


def _blocked(release: threading.Event, ran: list[str], name: str) -> str:
    ran.append(name)
    release.wait(RELEASE_S)
    return name


async def _refusal(call) -> tuple[ApiError, float]:
    started = time.monotonic()
    with pytest.raises(ApiError) as raised:
        await call
    return raised.value, time.monotonic() - started


async def _serves_again(worker: RenderWorker) -> None:
    """Once the overrunning call ends (refused until then), the worker runs calls again."""
    deadline = time.monotonic() + RELEASE_S
    while True:
        try:
            assert await worker.run(str, "after") == "after"
            return
        except ApiError as error:
            assert error.status == 503 and time.monotonic() < deadline
            await asyncio.sleep(0.01)


def test_a_call_past_its_deadline_is_a_504_and_new_calls_are_503_at_once_until_it_ends():
    worker, release, ran = RenderWorker(timeout_s=0.3), threading.Event(), []

    async def scenario() -> None:
        error, waited = await _refusal(worker.run(_blocked, release, ran, "slow"))
        assert error.status == 504 and error.error_type == "timeout_error"
        assert "generation.server.render_timeout_s=0.3 s" in error.message
        assert 0.3 <= waited < 2.0
        error, waited = await _refusal(worker.run(str, "next"))
        assert error.status == 503 and "outlived its deadline" in error.message
        assert waited < 0.1  # refused at once, not queued behind the stuck call
        release.set()
        await _serves_again(worker)
        assert ran == ["slow"]

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        assert worker.close(timeout_s=5.0)


def test_a_call_waiting_behind_a_running_one_is_dropped_unrun_at_its_deadline():
    worker, release, ran = RenderWorker(timeout_s=0.5), threading.Event(), []

    async def scenario() -> None:
        first = asyncio.ensure_future(worker.run(_blocked, release, ran, "first"))
        await asyncio.sleep(0.05)  # first is running, within its deadline
        error, waited = await _refusal(worker.run(_blocked, release, ran, "second"))
        assert error.status == 503 and "busy for this request's whole deadline" in error.message
        assert 0.5 <= waited < 2.0
        assert (await _refusal(first))[0].status == 504
        release.set()
        await _serves_again(worker)
        assert ran == ["first"]  # the dropped call never ran

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        assert worker.close(timeout_s=5.0)


def test_closing_waits_for_the_running_call_at_most_its_deadline_then_refuses_new_calls():
    worker, release, ran = RenderWorker(timeout_s=5.0), threading.Event(), []
    try:
        with ThreadPoolExecutor(1) as caller:
            running = caller.submit(asyncio.run, worker.run(_blocked, release, ran, "running"))
            while not ran:
                time.sleep(0.01)
            started = time.monotonic()
            assert worker.close(timeout_s=0.2) is False  # still running: left to end
            assert 0.2 <= time.monotonic() - started < 1.0
            release.set()
            assert running.result(timeout=RELEASE_S) == "running"
        error = asyncio.run(_refusal(worker.run(str, "late")))[0]
        assert error.status == 503 and "shutting down" in error.message
    finally:
        release.set()
        assert worker.close(timeout_s=5.0)


def test_a_slow_render_is_a_504_naming_the_key_the_others_503_and_the_server_renders_again(
    chat_format,
):
    """Over HTTP with a real slow render: 3.8 MB of text (1.9 M tokens, seconds for the
    tokenizer; under the body bound of this 4096-token context, 4 MiB) with a 0.5 s render
    deadline. The
    slow request is a 504 at the deadline; a request sent while it overruns is a 503 with
    Retry-After at once; once the tokenizer is done, requests are served again."""
    slow_text = [{"role": "user", "content": "x " * 1_900_000}]
    with (
        served(scripted(chat_format, "5"), chat_format, render_timeout_s=0.5) as client,
        ThreadPoolExecutor(1) as sender,
    ):
        slow = sender.submit(completion, client, slow_text)
        time.sleep(1.0)  # the slow render is past its deadline now
        meanwhile = completion(client, USER_ONLY)
        slow_answer = slow.result(timeout=30)
        assert slow_answer.status_code == 504, slow_answer.text[:300]
        assert "generation.server.render_timeout_s=0.5 s" in slow_answer.json()["error"]["message"]
        assert meanwhile.status_code == 503, meanwhile.text
        assert "retry-after" in meanwhile.headers
        assert "outlived its deadline" in meanwhile.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while (after := completion(client, USER_ONLY)).status_code == 503:
            assert time.monotonic() < deadline, "the worker never rendered again"
            time.sleep(0.2)
        assert after.status_code == 200, after.text
        assert slow_answer.elapsed.total_seconds() < 2.0
