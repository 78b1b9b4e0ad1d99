"""When to try again: exponential back-off with full jitter, never sooner than `Retry-After`.

A burst of overload answers (503s from a server at its concurrency limit) must not spend an
episode's retries in milliseconds; the jitter spreads the retries of episodes that failed
together, so they do not return together. Every 503 this project's servers send carries
`Retry-After: RETRY_AFTER_S`, and every client of them waits at least that long.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Mapping

RETRY_AFTER_S = 1
"""Seconds this project's servers ask a client to wait after a 503 (sent as `Retry-After`)."""


def retry_after_header() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def retry_after_s(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """The wait a `Retry-After` header asks for (seconds or an HTTP date), None if absent or
    unreadable."""
    value = headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_s(
    retry: int,
    *,
    base_s: float,
    max_s: float,
    retry_after: float | None = None,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """The wait before retry number `retry` (1 for the first): uniform in
    [0, min(max_s, base_s * 2**(retry - 1))], raised to `retry_after` when the server asked for
    more; never above `max_s`, so a server cannot stall a client past its own bound."""
    if retry < 1:
        raise ValueError(f"retry={retry} must be >= 1 (the first retry is 1)")
    ceiling = min(max_s, base_s * 2 ** (retry - 1))
    wait = uniform(0.0, ceiling)
    if retry_after is not None:
        wait = max(wait, retry_after)
    return min(wait, max_s)
