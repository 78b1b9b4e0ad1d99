"""The no-progress watchdog: a run in which no episode finishes and no step advances for
`run.progress_timeout_s` stops, saying what each role was waiting on at that moment.

Every single wait of the run has its own deadline, but those are sized for the slowest healthy
case (a 30B step, a two-hour SWE episode) and they nest: a stalled run could sit idle for the
sum of them before one fires, and the message of the one that fires names the last link of the
chain, not the stall. The watchdog bounds the whole by one figure the user picks per experiment,
and its report shows every role's wait at once, with its deadline and how long it had waited.

Roles are threads of the driver process: the trainer loop (the main thread) and the rollout
producer. A role says what it waits on with :func:`waiting` (`gymrl.cluster.ray_calls.wait_for`
does so for every Ray call); the outermost wait of a role is the one reported, since it says
what the role needs (a step's groups) rather than the call it is making for it. Progress is
:func:`progressed`: a group of episodes reached the replay buffer (a group dropped because it
cannot train, as when every episode of it failed, is none), a validation episode came back, or a
training step ended. When the watchdog
trips, :func:`raise_if_stalled`, called by the waits between their slices, raises
:class:`NoProgressError` in whichever role checks first, so the run ends within a second.
Without an active watch (actors, tests, the eval and serve recipes) every function is a no-op.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

_ROLE_NAMES = {"MainThread": "trainer loop"}


class NoProgressError(RuntimeError):
    """Nothing to train or validate came back and no step advanced for `run.progress_timeout_s`."""


@dataclass(frozen=True)
class Wait:
    """What a role waits on, since when (`time.monotonic()`), and its own deadline in seconds."""

    what: str
    since: float
    deadline_s: float


class ProgressWatch:
    """Trips when nothing progressed for `timeout_s`; its thread checks every `poll_s`."""

    def __init__(
        self, timeout_s: float, *, poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        if not timeout_s > 0:
            raise ValueError(f"run.progress_timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._poll_s = poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._last_what = "the watch started"
        self._waits: dict[str, list[Wait]] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: NoProgressError | None = None

    # ------------------------------------------------------------------ what the roles call
    def progressed(self, what: str) -> None:
        with self._lock:
            self._last, self._last_what = self._clock(), what

    @contextmanager
    def waiting(
        self, what: str, deadline_s: float, since: float | None = None
    ) -> Iterator[Callable[[str], None]]:
        role = _role()
        started = self._clock() if since is None else since
        with self._lock:
            waits = self._waits.setdefault(role, [])
            waits.append(Wait(what, started, deadline_s))
            depth = len(waits) - 1

        def retitle(now_what: str) -> None:
            with self._lock:
                waits[depth] = replace(waits[depth], what=now_what)

        try:
            yield retitle
        finally:
            with self._lock:
                waits.pop()

    def check(self) -> None:
        """Trip if nothing progressed for `timeout_s` (the watch thread calls this)."""
        with self._lock:
            if self.error is not None or self._clock() - self._last < self.timeout_s:
                return
            self.error = NoProgressError(self._report())

    def raise_if_stalled(self) -> None:
        if self.error is not None:
            raise self.error

    def _report(self) -> str:
        now = self._clock()
        roles = []
        for role, waits in sorted(self._waits.items()):
            if not waits:
                roles.append(f"{role}: not waiting (busy)")
                continue
            wait = waits[0]
            roles.append(
                f"{role}: waiting for {wait.what} for {now - wait.since:.1f} s "
                f"(its deadline {wait.deadline_s:g} s)"
            )
        return (
            f"no group of episodes reached training, no validation episode came back and no "
            f"step advanced for {now - self._last:.1f} s "
            f"(run.progress_timeout_s={self.timeout_s:g}; last progress: {self._last_what}). "
            f"At that moment: {'; '.join(roles) or 'no role was waiting'}"
        )

    # ------------------------------------------------------------------ the watch thread
    def start(self) -> None:
        """Make this the process's active watch and check it from a daemon thread."""
        global _active
        _active = self
        self._thread = threading.Thread(target=self._watch, name="progress-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(self._poll_s + 5.0)

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s):
            self.check()


_active: ProgressWatch | None = None


def _role() -> str:
    name = threading.current_thread().name
    return _ROLE_NAMES.get(name, name)


def progressed(what: str) -> None:
    """Record progress on the active watch, if any."""
    if _active is not None:
        _active.progressed(what)


@contextmanager
def waiting(
    what: str, deadline_s: float, since: float | None = None
) -> Iterator[Callable[[str], None]]:
    """Record that the calling role waits on `what` (bounded by `deadline_s`) during the block;
    `since` (`time.monotonic()`) when the wait began before the block (a wait taken in slices).
    The block gets a function that rewords `what` as the wait narrows (a call to many actors:
    which of them have not answered yet), so a report shows what is still missing."""
    watch = _active
    if watch is None:
        yield _unwatched
        return
    with watch.waiting(what, deadline_s, since) as retitle:
        yield retitle


def _unwatched(_what: str) -> None:
    """Rewording a wait that no watch records: nothing to do."""


def raise_if_stalled() -> None:
    """Raise the active watch's :class:`NoProgressError` once it tripped."""
    if _active is not None:
        _active.raise_if_stalled()
