"""Jobs on the real local Slurm of launch/local_slurm/ (two nodes on this host), as a user submits
and watches them: `sbatch launch/ray.sub <overrides>`, the job's state from `scontrol`, its log
(ray.sub's timestamped lines), the files its run writes, and every process it started, found by
the recipe runs' marker (`tests/recipes/recipe_runs.py`), which every step of the job inherits
(Ray's workers too: they are children of the `ray start` steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from tests.recipes.recipe_runs import MARKER, ROOT, recipe_command

RAY_SUB = ROOT / "launch" / "ray.sub"
LOCAL_SLURM = ROOT / "launch" / "local_slurm"
# ray.sub's log lines: "[ray.sub 2026-12-06T08:13:42.864Z] <message>".
LOG_LINE = re.compile(r"^\[ray\.sub (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z\] (.*)$")
POLL_S = 0.5

T = TypeVar("T")


@dataclass(frozen=True)
class LocalSlurm:
    """The running cluster: its slurm.conf, which every Slurm command finds through SLURM_CONF."""

    conf: Path

    def env(self, marker: str, **extra: str) -> dict[str, str]:
        """A job's environment (sbatch exports it to every step): this cluster, this checkout's
        code first (Ray's workers inherit it), this interpreter for ray.sub's `python`, a CPU
        node's 0 GPUs, and the marker that finds the job's processes."""
        path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        return (
            os.environ
            | {
                "SLURM_CONF": str(self.conf),
                "PYTHONPATH": os.pathsep.join(filter(None, path)),
                "PYTHON": sys.executable,
                "GPUS_PER_NODE": "0",
                MARKER: marker,
            }
            | extra
        )

    def run(self, *command: str, timeout: float = 60) -> str:
        """A Slurm client command's output; fails with its stderr."""
        done = subprocess.run(
            command,
            env=os.environ | {"SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
        return done.stdout


def submit(
    cluster: LocalSlurm,
    out: Path,
    *sbatch_args: str,
    overrides: tuple[str, ...],
    env: dict[str, str],
) -> str:
    """`sbatch <sbatch_args> launch/ray.sub <the recipe's overrides>` from the repository root,
    its run folder and Hydra's `out/run`, its log `out/job-<id>.out` (appended across requeues);
    the job's id."""
    # recipe_command's overrides, without the interpreter and the script: ray.sub runs those.
    recipe_overrides = recipe_command(out / "run", *overrides)[2:]
    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={out}/job-%j.out",
            "--open-mode=append",
            *sbatch_args,
            str(RAY_SUB),
            *recipe_overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def job_fields(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    """`scontrol show job --oneliner`, as key=value pairs (JobState, ExitCode, Requeue, ...)."""
    line = cluster.run("scontrol", "show", "job", "--oneliner", job_id)
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


def wait_until(check: Callable[[], T], timeout_s: float, what: str) -> T:
    """The first truthy value of `check()`, polled every POLL_S; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(POLL_S)
    return value


def wait_until_ended(cluster: LocalSlurm, job_id: str, timeout_s: float) -> int:
    """The job's exit status once it has ended (COMPLETED, FAILED, ...; a requeued job's
    PENDING does not count)."""
    ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    fields = wait_until(
        lambda: (f := job_fields(cluster, job_id))["JobState"] in ended and f,
        timeout_s,
        f"job {job_id} ending",
    )
    return int(fields["ExitCode"].split(":")[0])


def log_lines(log: Path) -> list[tuple[datetime, str]]:
    """ray.sub's lines of a job log: (UTC time, message)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [
        (datetime.fromisoformat(m.group(1)).replace(tzinfo=UTC), m.group(2))
        for line in lines
        if (m := LOG_LINE.match(line))
    ]


def first_time(log: Path, prefix: str, after: datetime | None = None) -> datetime:
    """When ray.sub first logged a message starting with `prefix` (after `after`)."""
    times = [t for t, message in log_lines(log) if message.startswith(prefix)]
    times = [t for t in times if after is None or t > after]
    assert times, f"no '{prefix}' line in {log}"
    return times[0]


def phases(log: Path) -> list[str]:
    """The phases ray.sub logged, in order."""
    return [m.removeprefix("phase: ") for _, m in log_lines(log) if m.startswith("phase: ")]


def now() -> datetime:
    return datetime.now(UTC)
