"""The one supervisor of child processes that start children of their own: SGLang servers
(`gymrl.generation.sglang_servers`) and a launched Gym deployment (`nemo_gym_ext.gym_launch`).

Both fork helpers (SGLang its scheduler and detokenizer, Gym's launcher every server and a Ray
instance), so a child runs in a new session, is its process group's leader, and is stopped as a
group: SIGTERM, a grace period for the leader and every member, then SIGKILL for whatever is
left (a member that ignored the first signal outlives its leader otherwise). Signals go to the
group, never to processes by name. Output is appended to a log, whose first error (or, without
one, its tail) goes into the callers' start-up errors: a server that fails at import prints its
traceback long before the launcher's shutdown noise ends the log.

With `die_with_parent`, the kernel SIGKILLs the child when the thread that started it ends
(Linux), so a child whose owner is killed without `stop()` (`ray.kill`, a crashed worker) does
not hold its GPUs until the job ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_GONE_POLL_S = 0.2
LOG_TAIL_CHARS = 3000
_TRACEBACK = "Traceback (most recent call last):"
# A line that names an exception, `ModuleNotFoundError: No module named 'x'`, after an optional
# `(label)` prefix such as Ray's `(pid=12)`.
_PREFIX = re.compile(r"^\(.*?\)\s")
_ERROR_LINE = re.compile(r"^[\w.]*[A-Z]\w*(Error|Exception)\b(:|$)")
_FIRST_ERROR_LINES = 40


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel SIGKILL the child when its parent dies (Linux), or None.

    Only the direct child is armed (forked children do not inherit the setting); SGLang arms its
    own scheduler and detokenizer processes the same way (`kill_itself_when_parent_died`), so a
    whole server follows. "Parent" is the thread that started the child: start children from a
    thread that lives as long as they do (a Ray actor's method thread does).
    """
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


class ChildProcess:
    """One child in its own process group, its output appended to `log_path`."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.command = list(command)
        self.log_path = Path(log_path)
        self._env = dict(env)
        self._cwd = cwd
        self._die_with_parent = die_with_parent
        self._process: subprocess.Popen[bytes] | None = None

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
            self._process = subprocess.Popen(
                self.command,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,  # its own process group: stopped as one
                preexec_fn=die_with_parent() if self._die_with_parent else None,
            )

    def exit_code(self) -> int | None:
        """The child's exit code, or None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    def stop(self, grace_s: float) -> None:
        """SIGTERM the group, wait up to `grace_s` for the leader and every member, SIGKILL
        what is left and wait for it as long again. A no-op before `start`."""
        if self._process is None:
            return
        group = self._process.pid  # the session leader's pid is the group's id
        _signal_group(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=grace_s)
        _wait_group_gone(group, grace_s)
        _signal_group(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=grace_s)
        _wait_group_gone(group, grace_s)

    def log_first_error(self) -> str | None:
        """The log's first error (:func:`first_error`); None without a log or an error."""
        return first_error(self.log_path) if self.log_path.is_file() else None

    def log_tail(self) -> str:
        if not self.log_path.is_file():
            return "(no log written)"
        with self.log_path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - LOG_TAIL_CHARS))
            return log.read().decode("utf-8", errors="replace")


def first_error(log_path: Path) -> str | None:
    """The first error of a log: from its first traceback to the line naming the exception
    that ends it, or, without a traceback, the first line naming one; at most 40 lines and
    `LOG_TAIL_CHARS`. None when no line looks like an error."""
    block: list[str] = []
    with log_path.open(encoding="utf-8", errors="replace") as log:
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
