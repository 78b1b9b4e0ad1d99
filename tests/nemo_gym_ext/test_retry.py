"""Back-off with jitter, bounded, and never sooner than the server's `Retry-After`."""

from __future__ import annotations

import email.utils
import random

import pytest

from nemo_gym_ext.retry import backoff_s, retry_after_s


def test_the_ceiling_doubles_per_retry_up_to_the_maximum():
    highest = [
        backoff_s(retry, base_s=0.5, max_s=5.0, uniform=lambda lo, hi: hi) for retry in range(1, 7)
    ]
    assert highest == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    lowest = [
        backoff_s(retry, base_s=0.5, max_s=5.0, uniform=lambda lo, hi: lo) for retry in (1, 4)
    ]
    assert lowest == [0.0, 0.0]


def test_jitter_spreads_waits_over_the_whole_window():
    rng = random.Random(0)
    waits = [backoff_s(3, base_s=1.0, max_s=30.0, uniform=rng.uniform) for _ in range(2000)]
    assert 0.0 <= min(waits) < 0.1 and 3.9 < max(waits) <= 4.0
    assert 1.8 < sum(waits) / len(waits) < 2.2


def test_retry_after_is_a_floor_bounded_by_the_maximum():
    assert backoff_s(1, base_s=0.1, max_s=30.0, retry_after=2.0) == 2.0
    assert backoff_s(1, base_s=0.1, max_s=30.0, retry_after=600.0) == 30.0
    with pytest.raises(ValueError, match="retry=0 must be >= 1"):
        backoff_s(0, base_s=1.0, max_s=2.0)


def test_retry_after_is_read_as_seconds_or_an_http_date():
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after": " 1.5 "}) == 1.5
    assert retry_after_s({}) is None
    assert retry_after_s({"retry-after": "soon"}) is None
    date = email.utils.formatdate(1_000_010.0, usegmt=True)
    assert retry_after_s({"retry-after": date}, now=1_000_000.0) == pytest.approx(10.0)
    assert retry_after_s({"retry-after": "-4"}) == 0.0
