"""Waiting on Ray: always with a deadline, and with the actor's own exception on failure.

Ray wraps an exception raised inside an actor in `RayTaskError`; the recipe needs the original
(a contiguity error is a message for the user, not a crash), and a wait that never ends would
stall a run until walltime.

Long waits are taken in slices of at most `_SLICE_S`, each inside `gymrl.run.stop.stops_held`:
a stop that a signal asks for while the main thread is inside `ray.get` (the first Ctrl-C, the
stop deadline, a second Ctrl-C) is raised when that slice returns, so it comes out within a
second and is never lost in Ray's compiled code (which passes on only `KeyboardInterrupt`).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from gymrl.run.progress import raise_if_stalled, waiting
from gymrl.run.stop import stops_held

_SLICE_S = 1.0


def wait_for(ref: Any, *, timeout_s: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout_s`; raises the actor's exception, or TimeoutError naming
    `what` did not finish. The no-progress watchdog (gymrl.run.progress) sees the wait, and
    stops it between slices once it tripped."""
    deadline = time.monotonic() + timeout_s
    try:
        with waiting(what, timeout_s):
            return _wait_in_slices(ref, deadline)
    except GetTimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s") from None
    except RayTaskError as error:
        if isinstance(error.cause, Exception):
            raise error.cause from None
        raise


def _wait_in_slices(ref: Any, deadline: float) -> Any:
    while True:
        raise_if_stalled()
        left = deadline - time.monotonic()
        try:
            with stops_held():
                return ray.get(ref, timeout=max(0.0, min(left, _SLICE_S)))
        except GetTimeoutError:
            if left <= _SLICE_S:
                raise


def close_actor(actor: Any, *, timeout_s: float | None = None) -> None:
    """End `actor`: with `timeout_s`, first its `close()` within that deadline; then, whether or
    not that worked (an actor whose constructor failed cannot close), kill its process, so
    nothing it started outlives the run."""
    try:
        if timeout_s is not None:
            wait_for(actor.close.remote(), timeout_s=timeout_s, what="closing an actor")
    finally:
        ray.kill(actor)
