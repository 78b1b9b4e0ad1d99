"""The policy server's one render worker, with a deadline on every call.

Rendering a prompt (the chat template, the tokenizer, the divergence watch's check) and parsing
an answer run off the event loop on one thread, since a Hugging Face fast tokenizer may fail when
it is used from several threads at once. Until issue 42 they had no deadline: one slow render
(30 MB of text to tokenise took 41-45 s on a 2-core CPU) held every later request of the run
behind it.

A thread cannot be stopped, so the decision is what the requests see. Each call gets `timeout_s`
in all, waiting for the worker and running on it:

* a call still waiting at its deadline is dropped before it runs and answered 503 with
  Retry-After ("not now": the worker was busy the whole time);
* a call running at its deadline is answered 504 naming the key; it runs on to its end, its
  result dropped, and the worker stays one thread, so the tokenizer is never shared;
* while a call runs past its deadline, new calls are answered 503 at once with Retry-After
  instead of queueing behind it; calls already waiting keep their own deadlines.

So no request waits more than `timeout_s` for the worker, and the server renders again as soon
as the overrunning call ends. Not chosen: a fresh worker beside a stuck one, which would need a
tokenizer of its own and would let stuck renders pile up threads. What keeps renders short in the
first place is the body's bound (`request_body`): a body the context cannot hold is refused
before it is read.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gymrl.generation.server.api_error import ApiError

TIMEOUT_KEY = "generation.server.render_timeout_s"

Result = TypeVar("Result")


class RenderWorker:
    """One thread that runs the server's rendering and parsing, each call within `timeout_s`
    (the module docstring says what a request sees past it). Calls come from the event loop."""

    def __init__(self, *, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"{TIMEOUT_KEY}={timeout_s} must be > 0 seconds")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-server-render")
        self._idle = threading.Event()
        self._idle.set()
        # The deadline of the call running now (None while idle): written by the worker thread,
        # read by the event loop, one attribute at a time.
        self._running_until: float | None = None
        self._closed = False

    async def run(self, call: Callable[..., Result], *args: object) -> Result:
        """`call(*args)` on the worker; a refusal (503, 504) is an :class:`ApiError`."""
        if self._closed:
            raise ApiError(
                503, "the policy server is shutting down", error_type="service_unavailable_error"
            )
        now = time.monotonic()
        running_until = self._running_until
        if running_until is not None and now > running_until:
            raise self._busy(
                f"is still running a call that outlived its deadline {now - running_until:.1f} s "
                "ago (it cannot be stopped, only waited for)"
            )
        future = self._pool.submit(self._timed, now + self.timeout_s, call, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            # wait_for cancelled the future: that succeeds only if it had not started.
            if future.cancelled():
                raise self._busy("was busy for this request's whole deadline") from None
            raise ApiError(
                504,
                f"rendering this request (its prompt, or its answer) did not finish within "
                f"{TIMEOUT_KEY}={self.timeout_s} s; it runs on to its end on the server's one "
                "render worker, which refuses other requests until then; send a shorter "
                f"conversation, or raise {TIMEOUT_KEY} if renders this long are expected",
                error_type="timeout_error",
            ) from None

    def close(self, timeout_s: float) -> bool:
        """Refuse new calls, drop the waiting ones and wait up to `timeout_s` for the one
        running; False if it still runs then (it is left to end on its own)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        return self._idle.wait(timeout_s)

    def _timed(self, deadline: float, call: Callable[..., Result], *args: object) -> Result:
        self._idle.clear()
        self._running_until = deadline
        try:
            return call(*args)
        finally:
            self._running_until = None
            self._idle.set()

    def _busy(self, why: str) -> ApiError:
        return ApiError(
            503,
            f"the policy server's render worker {why}; retry later ({TIMEOUT_KEY}="
            f"{self.timeout_s} s bounds each render)",
            error_type="service_unavailable_error",
        )
