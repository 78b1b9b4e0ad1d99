"""Stopping a run on SIGINT or SIGTERM without losing its work.

Slurm sends SIGTERM some time before it kills a preempted job (`--signal`, `KillWait`), and a
person presses Ctrl-C; either way the run should end on its own terms: the step in progress is
finished (or abandoned, `stop.step_in_progress`), a checkpoint of the last finished step is
written (`stop.checkpoint`), the servers and actors are closed, and the exit status names the
signal (128 + its number, the shell's convention: 130 for SIGINT, 143 for SIGTERM), so a wrapper
script can tell a preemption from a failure and requeue with `resume=true`.

:class:`StopSignals` turns the signals into a :class:`StopRequested` raised in the main thread:

* outside a step (setup, saving, the first signal in `abandon` mode), at once;
* inside a step in `finish` mode, when the step ends (:meth:`StopSignals.step_finished`), or when
  `stop.deadline_s` passes first (a SIGALRM timer), whichever is earlier;
* a second signal while a step is finishing abandons it at once.

Once raised, further signals are only reported: cleanup has its own deadlines and must not be
cut short by an impatient second Ctrl-C. `StopRequested` derives from `BaseException`, like
`KeyboardInterrupt`, so that no `except Exception` on the way swallows it.

Waits inside Ray's compiled code are the exception: Ray checks for signals in its own callback,
which passes only `KeyboardInterrupt` and `SystemExit` on, so a `StopRequested` raised by the
handler there is either reported as "Exception ignored" and lost, or left pending until the wait
ends (a 30 s `ray.wait` then fails with a `SystemError` 30 s later). A wait on Ray therefore
runs inside :func:`stops_held` (`gymrl.cluster.ray_calls.wait_for` does): there the handler only
records the stop, and it is raised, in Python, the moment the Ray call returns.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(BaseException):
    """The run was asked to stop by `signum`; `step_finished` says whether the step it arrived
    in (if any) was completed."""

    def __init__(self, signum: int, *, step_finished: bool, reason: str):
        self.signum = signum
        self.step_finished = step_finished
        super().__init__(f"{signal.Signals(signum).name}: {reason}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_installed: StopSignals | None = None  # the handlers in place, if any (one process, one run)


@contextmanager
def stops_held() -> Iterator[None]:
    """Run the block with any stop the installed :class:`StopSignals` asks for held until it
    ends, then raised (see the module docstring). Outside the main thread, or with no handlers
    installed, a plain block: signal handlers only ever run in the main thread."""
    signals = _installed
    if signals is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with signals.holding():
        yield


def stop_request_behind(error: BaseException) -> StopRequested | None:
    """The `StopRequested` that `error` is, or that caused it; None for any other error.

    A signal that arrives while the main thread waits inside Ray's compiled code (`ray.wait`,
    `ray.get`) has its handler's exception wrapped: Cython reports a `SystemError` ("returned a
    result with an exception set") whose cause is the `StopRequested`."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, StopRequested):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class StopSignals:
    """SIGINT/SIGTERM handlers of the recipe's main thread (see the module docstring)."""

    def __init__(self, step_in_progress: Literal["finish", "abandon"], deadline_s: float):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s} must be > 0")
        self._finish = step_in_progress == "finish"
        self._deadline_s = deadline_s
        self._in_step = False
        self._pending: int | None = None  # a signal waiting for the step to end
        self._raised = False
        self._holding = 0  # depth of `holding()` blocks
        self._held: StopRequested | None = None  # raised when the outermost one ends

    def install(self) -> None:
        """Take over SIGINT and SIGTERM (again after `ray.init`, which sets its own SIGTERM
        handler in the driver). Only the main thread can install signal handlers."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals.install() must run in the main thread")
        global _installed
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGALRM, self._on_deadline)
        _installed = self

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Inside: the stop a handler asks for is recorded, then raised as the block ends (it
        wins over whatever error the block raised, which becomes its context). Handlers and this
        block both run in the main thread, so a stop is raised exactly once: in the block, or
        by the handler outside it."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding and self._held is not None:
                stop, self._held = self._held, None
                raise stop

    @contextmanager
    def step(self) -> Iterator[None]:
        """Marks a training step: a signal inside it waits for the step (in `finish` mode)."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def step_finished(self) -> None:
        """Call between steps: raises the stop a signal asked for during the step just ended."""
        if self._pending is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._raise(self._pending, step_finished=True, reason="stopping after the step")

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self._raised:
            print(f"{name} again: already stopping, closing servers and actors", flush=True)
            return
        if self._pending is not None:
            self._raise(signum, step_finished=False, reason="second signal, step abandoned")
        if self._in_step and self._finish:
            self._pending = signum
            print(
                f"{name}: finishing the step in progress (at most {self._deadline_s:g} s), "
                "then stopping; send it again to abandon the step",
                file=sys.stderr,
                flush=True,
            )
            signal.setitimer(signal.ITIMER_REAL, self._deadline_s)
            return
        self._raise(signum, step_finished=not self._in_step, reason="stopping now")

    def _on_deadline(self, _signum: int, _frame: object) -> None:
        if self._pending is not None and not self._raised:
            self._raise(
                self._pending,
                step_finished=False,
                reason=f"the step did not finish within stop.deadline_s={self._deadline_s:g} s; "
                "step abandoned",
            )

    def _raise(self, signum: int, *, step_finished: bool, reason: str) -> None:
        self._raised = True
        self._pending = None
        stop = StopRequested(signum, step_finished=step_finished, reason=reason)
        if self._holding:
            self._held = stop
            return
        raise stop
