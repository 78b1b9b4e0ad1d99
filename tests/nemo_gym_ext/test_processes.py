"""`first_error`: what a failed child's log shows in a start-up error (the launch tests see it
through a whole stand-in Gym deployment; these the log shapes one by one). And the guard: a
child's whole process group is stopped when its owner dies without stopping it."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_gym_ext.processes import LOG_TAIL_CHARS, ChildProcess, first_error


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (  # a traceback among other lines: from its start to the line naming the exception
            'starting\nTraceback (most recent call last):\n  File "a.py", line 1\n'
            "    except ImportError: pass\nImportError: cannot import name 'x'\nmore\n"
            "ValueError: a later one\n",
            'Traceback (most recent call last):\n  File "a.py", line 1\n'
            "    except ImportError: pass\nImportError: cannot import name 'x'",
        ),
        (  # without a traceback, the first line naming an error
            "ok\n(pid=4) OSError: [Errno 98] Address already in use\nRuntimeError: later\n",
            "(pid=4) OSError: [Errno 98] Address already in use",
        ),
        ("everything went fine\nan error-free line: no Error here\n", None),
    ],
    ids=["traceback", "error_line", "none"],
)
def test_the_first_error_of_a_log(tmp_path, log, expected):
    path = tmp_path / "log"
    path.write_text(log)
    assert first_error(path) == expected


def test_a_traceback_without_an_end_is_cut_to_forty_lines_and_the_tail_size(tmp_path):
    path = tmp_path / "log"
    frames = "".join(f'  File "f{i}.py", line {i}, {"x" * 200}\n' for i in range(100))
    path.write_text("Traceback (most recent call last):\n" + frames)
    shown = first_error(path)
    assert shown is not None and shown.startswith("Traceback")
    assert len(shown) <= LOG_TAIL_CHARS and len(shown.splitlines()) <= 40


def test_a_restarted_child_s_error_and_tail_come_from_its_own_start(tmp_path):
    """The log is appended to across starts (a resumed run): an error an earlier start wrote is
    not this start's cause, and neither is its output in the tail."""
    log = tmp_path / "child.log"
    log.write_text("Traceback (most recent call last):\nImportError: fixed since\nold tail\n")
    child = ChildProcess(
        [
            sys.executable,
            "-c",
            "print('starting', flush=True); raise SystemExit('RuntimeError: port taken')",
        ],
        log_path=log,
        env={},
        stop_grace_s=5.0,
    )
    child.start()
    try:
        deadline = time.monotonic() + 60
        while child.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        child.stop(5.0)
    assert child.log_first_error() == "RuntimeError: port taken"
    assert child.log_tail() == "starting\nRuntimeError: port taken\n"


# A child that forks a grandchild (as Gym's launcher and SGLang do), writes both pids to argv[1]
# and sleeps; with argv[2] == "stubborn" the grandchild ignores SIGTERM.
_FAMILY = """
import os, subprocess, sys, time
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if sys.argv[2] == "stubborn" else ""
child = subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}time.sleep(600)"])
time.sleep(0.5)  # the grandchild's handler is set before anyone signals it
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

# The owner: starts the family under ChildProcess, then sleeps until the test kills it.
_OWNER = """
import sys, time
from nemo_gym_ext.processes import ChildProcess
pids, kind, log = sys.argv[1:]
family = ChildProcess([sys.executable, "-c", FAMILY, pids, kind], log_path=log, env={},
                      stop_grace_s=1.0)
family.start()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_an_owner_killed_without_stop_takes_the_whole_group_with_it(tmp_path, kind):
    """SIGKILL gives the owner no chance to stop its child: the guard stops the leader and what
    it forked, SIGKILLing a member that ignores SIGTERM after the grace."""
    pids_path = tmp_path / "pids"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _OWNER.replace("FAMILY", repr(_FAMILY)),
            str(pids_path),
            kind,
            str(tmp_path / "log"),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert _wait_for(pids_path.exists, 30), "the family never started"
        family = [int(pid) for pid in pids_path.read_text().split()]
        assert all(_alive(pid) for pid in family)
        owner.kill()
        owner.wait()
        assert _wait_for(lambda: not any(_alive(pid) for pid in family), 15), (
            f"{[pid for pid in family if _alive(pid)]} outlived their owner"
        )
    finally:
        owner.kill()
        for pid in [int(p) for p in pids_path.read_text().split()] if pids_path.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_stop_leaves_neither_the_group_nor_its_guard(tmp_path):
    pids_path = tmp_path / "pids"
    family = ChildProcess(
        [sys.executable, "-c", _FAMILY, str(pids_path), "polite"],
        log_path=tmp_path / "log",
        env={},
        stop_grace_s=1.0,
    )
    family.start()
    assert family.pid is not None
    assert _wait_for(pids_path.exists, 30)
    members = [int(pid) for pid in pids_path.read_text().split()]
    guards = _guards_of(family.pid)
    assert len(guards) == 1, "the child started without its guard"
    family.stop(grace_s=5)
    assert not any(_alive(pid) for pid in members)
    assert not _alive(guards[0]), "the guard outlived stop()"


def test_a_child_whose_guard_cannot_start_is_stopped_before_the_error_leaves(tmp_path, monkeypatch):
    def no_guard(self, group):
        raise OSError("no guard today")

    monkeypatch.setattr(ChildProcess, "_start_guard", no_guard)
    pids_path = tmp_path / "pids"
    family = ChildProcess(
        [sys.executable, "-c", _FAMILY, str(pids_path), "polite"],
        log_path=tmp_path / "log",
        env={},
        stop_grace_s=1.0,
    )
    with pytest.raises(OSError, match="no guard today"):
        family.start()
    assert family.pid is not None and not _alive(family.pid)


def _guards_of(group: int) -> list[int]:
    """Live children of this process running the guard of process group `group`."""
    guards = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not _alive(int(entry.name)):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        if parent == os.getpid() and b"killpg" in b"".join(argv) and str(group).encode() in argv:
            guards.append(int(entry.name))
    return guards
