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
from collections.abc import Sequence
from typing import Any, NoReturn

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
        _raise_cause(error)


def wait_for_all(refs: Sequence[Any], *, timeout_s: float, what: str, member: str) -> list[Any]:
    """The results of `refs`, in their order, within one deadline `timeout_s` for all: as
    :func:`wait_for` (the watchdog sees it, a stop comes out within a slice), for a call made to
    many actors at once, such as a step of every trainer rank. Each ref is its `member` by its
    index ("rank 3"): the watchdog's report and the TimeoutError name the members that had not
    answered, since in a collective call the one that hangs is the cause and the rest wait for
    it. A member's exception is raised as soon as its call fails, not once every member has
    answered (in a collective, the others never would)."""
    started = time.monotonic()
    deadline = started + timeout_s
    index_of = {ref: index for index, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)

    def missing() -> str:
        return _members(member, sorted(index_of[ref] for ref in pending), len(refs))

    with waiting(f"{what} from {missing()}", timeout_s) as retitle:
        while pending:
            raise_if_stalled()
            left = deadline - time.monotonic()
            with stops_held():
                done, pending = ray.wait(
                    pending, num_returns=len(pending), timeout=max(0.0, min(left, _SLICE_S))
                )
            for ref in done:
                try:
                    with stops_held():
                        results[index_of[ref]] = ray.get(ref, timeout=max(left, _SLICE_S))
                except RayTaskError as error:
                    _raise_cause(error)
            if pending and left <= _SLICE_S:
                raise TimeoutError(
                    f"{what} did not finish within {timeout_s:g} s: no answer from {missing()}"
                )
            if done:
                retitle(f"{what} from {missing()}")
    return results


def _members(member: str, indices: list[int], count: int) -> str:
    """`rank 2 (of 4)`, `ranks 0-3, 7 (of 8)`: indices as runs of consecutive ones."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    named = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"{member}{'' if len(indices) == 1 else 's'} {named} (of {count})"


def _raise_cause(error: RayTaskError) -> NoReturn:
    """The actor's own exception where it is one (see the module docstring), else Ray's."""
    if isinstance(error.cause, Exception):
        raise error.cause from None
    raise error


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
