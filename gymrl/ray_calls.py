"""Waiting on Ray: always with a deadline, and with the actor's own exception on failure.

Ray wraps an exception raised inside an actor in `RayTaskError`; the recipe needs the original
(a contiguity error is a message for the user, not a crash), and a wait that never ends would
stall a run until walltime.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayTaskError


def wait_for(ref: Any, *, timeout_s: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout_s`; raises the actor's exception, or TimeoutError naming
    `what` did not finish."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None
    except RayTaskError as error:
        if isinstance(error.cause, Exception):
            raise error.cause from None
        raise
