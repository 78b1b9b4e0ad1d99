"""The one supervisor of child processes that start children of their own: SGLang servers
(`gymrl.generation.sglang.servers`) and a launched Gym deployment (`nemo_gym_ext.gym_launch`).

Both fork helpers (SGLang its scheduler and detokenizer, Gym's launcher every server and a Ray
instance), so a child runs in a new session, is its process group's leader, and is stopped as a
group: SIGTERM, a grace period for the leader and every member, then SIGKILL for whatever is
left (a member that ignored the first signal outlives its leader otherwise). Signals go to the
group, never to processes by name. Output is appended to a log, whose first error (or, without
one, its tail) goes into the callers' start-up errors: a server that fails at import prints its
traceback long before the launcher's shutdown noise ends the log. Only this start's part of the
log is read: a resumed run appends to the log of the attempts before it, whose errors may have
been fixed since.

Every child has a guard: a small process of its own, in a session of its own, that holds the read
end of a pipe whose write end only the owner holds. When the owner dies without `stop()`
(`ray.kill`, a worker SIGKILLed by Ray's memory monitor, a crash), the kernel closes the write end,
the guard reads end-of-file and stops the whole group the same way `stop()` does. So neither
the leader nor what it forked (Gym's servers and its Ray instance, SGLang's scheduler) outlives
its owner, holding ports, memory or GPUs until the job ends. A kernel parent-death signal
would not do: it reaches the leader only, and SIGKILL gives the leader no chance to stop the rest.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_GONE_POLL_S = 0.2
_GUARD_REAPED_S = 5.0  # a SIGKILLed guard is reaped at once; this only bounds the wait
LOG_TAIL_CHARS = 3000
_TRACEBACK = "Traceback (most recent call last):"
# A line that names an exception, `ModuleNotFoundError: No module named 'x'`, after an optional
# `(label)` prefix such as Ray's `(pid=12)`.
_PREFIX = re.compile(r"^\(.*?\)\s")
_ERROR_LINE = re.compile(r"^[\w.]*[A-Z]\w*(Error|Exception)\b(:|$)")
_FIRST_ERROR_LINES = 40


class ChildProcess:
    """One child in its own process group, its output appended to `log_path`."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str],
        stop_grace_s: float,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        """`stop_grace_s`: the grace the guard gives the group, should the owner die (the
        owner's own `stop` takes its grace as an argument)."""
        self.command = list(command)
        self.log_path = Path(log_path)
        self._env = dict(env)
        self._cwd = cwd
        self._stop_grace_s = stop_grace_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log_start = 0  # where this start's output begins in the log
        self._guard: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # the pipe's write end, held by this process only

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def started(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError(f"{self.command[0]} was already started (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._log_start = log.seek(0, os.SEEK_END)
            self._process = subprocess.Popen(
                self.command,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,  # its own process group: stopped as one
            )
        try:
            self._start_guard(self._process.pid)
        except BaseException:
            self.stop(self._stop_grace_s)  # a child without its guard must not outlive the error
            raise

    def _start_guard(self, group: int) -> None:
        """Start the guard of `group` (see the module's docstring). The pipe is made after the
        child started, and is not inheritable, so no member of the group holds its write end."""
        read_end, self._lifeline = os.pipe()
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-c", _GUARD, str(group), str(self._stop_grace_s)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # signals to the owner's group do not reach it
            )
        finally:
            os.close(read_end)

    def exit_code(self) -> int | None:
        """The child's exit code, or None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the group, wait up to `grace_s` for the leader and every member, SIGKILL
        what is left and wait for it as long again. A no-op before `start`. The guard is
        retired first, so it never signals a group id the system may have reused."""
        if self._process is None:
            return
        self._retire_guard()
        group = self._process.pid  # the session leader's pid is the group's id
        _signal_group(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=grace_s)
        _wait_group_gone(group, grace_s)
        _signal_group(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=grace_s)
        _wait_group_gone(group, grace_s)

    def _retire_guard(self) -> None:
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait(timeout=_GUARD_REAPED_S)
            self._guard = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def log_first_error(self) -> str | None:
        """The first error this start wrote to the log (:func:`first_error`); None without a
        log or an error."""
        return first_error(self.log_path, self._log_start) if self.log_path.is_file() else None

    def log_tail(self) -> str:
        """The last `LOG_TAIL_CHARS` bytes this start wrote to the log."""
        if not self.log_path.is_file():
            return "(no log written)"
        with self.log_path.open("rb") as log:
            end = log.seek(0, os.SEEK_END)
            log.seek(max(self._log_start, end - LOG_TAIL_CHARS))
            return log.read().decode("utf-8", errors="replace")


def first_error(log_path: Path, start: int = 0) -> str | None:
    """The first error of a log from byte `start` on: from its first traceback to the line
    naming the exception that ends it, or, without a traceback, the first line naming one; at
    most 40 lines and `LOG_TAIL_CHARS`. None when no line looks like an error."""
    block: list[str] = []
    with log_path.open("rb") as raw:
        raw.seek(start)
        log = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
        for line in log:
            line = line.rstrip("\n")
            bare = _PREFIX.sub("", line, count=1)
            if not block:
                if _TRACEBACK in bare:
                    block.append(line)
                elif _ERROR_LINE.match(bare):
                    return line[:LOG_TAIL_CHARS]
                continue
            block.append(line)
            if _ERROR_LINE.match(bare) or len(block) == _FIRST_ERROR_LINES:
                break
    return "\n".join(block)[:LOG_TAIL_CHARS] if block else None


# The guard: blocks on its stdin (the lifeline) until the owner is gone, then stops the group as
# `ChildProcess.stop` does. Standard library only: it runs in the interpreter that runs the owner.
_GUARD = """
import os, signal, sys, time
group, grace = int(sys.argv[1]), float(sys.argv[2])
sys.stdin.buffer.read()
def signal_group(signum):
    try:
        os.killpg(group, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False
if signal_group(signal.SIGTERM):
    deadline = time.monotonic() + grace
    while signal_group(0) and time.monotonic() < deadline:
        time.sleep(0.2)
    signal_group(signal.SIGKILL)
"""


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _wait_group_gone(group: int, timeout_s: float) -> None:
    """Until no process of `group` is left (zombies awaiting their reaper count as gone)."""
    deadline = time.monotonic() + timeout_s
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(_GONE_POLL_S)


def group_members(group: int) -> list[int]:
    """Live (non-zombie) processes of process group `group`, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp.
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(entry.name))
    return members
