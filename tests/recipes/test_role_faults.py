"""The Ray side of the fault matrix (docs/reliability.md), through the real entry point: after
the first step, one role's process is killed (SIGKILL, as the OOM killer or a lost node would),
and the run must stop within a deadline with one message naming the role, exit status 1, no
traceback, and no process left behind. Minutes per case on two cores, so `slow`.
"""

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.recipes.recipe_runs import (
    MARKER,
    marked_processes,
    recipe_command,
    wait_for_first_step,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# A dead role is noticed at the next call to it (at the latest the next step's train or refit)
# or when episodes failing against a dead policy server use up the failure budget.
STOP_DEADLINE_S = 300


@pytest.mark.parametrize(
    ("actor", "cause"),
    [
        # Whichever comes first: the next refit reaches the dead actor, or the agents' calls to
        # its closed port use up the failure budget.
        ("GenerationServer", r"GenerationServer|RolloutBudgetExceeded: .*policy server at"),
        ("PolicyTrainerActor", "PolicyTrainerActor"),
        ("ReplayBuffer", "ReplayBuffer"),
        # The collector: the producer's wait for its groups ends with the actor's death, which
        # the trainer raises at its next look (within a slice of its wait for the batch).
        ("GymShard", "GymShard"),
    ],
)
def test_a_killed_role_stops_the_run_naming_the_cause(tmp_path, actor, cause):
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "run"
    command = recipe_command(
        out, "+experiment=smoke", "grpo.num_steps=50", "checkpoint.every_n_steps=0"
    )
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        run = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err_file
        )
        try:
            wait_for_first_step(run, out, stderr)
            (victim,) = [
                p for p in marked_processes(marker) if f"ray::{actor}" in " ".join(p.cmdline())
            ]
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            code = run.wait(timeout=STOP_DEADLINE_S)
            stop_s = time.monotonic() - killed
        finally:
            if run.poll() is None:
                run.kill()
    errors = stderr.read_text()
    print(f"{actor} killed -> exit {code} after {stop_s:.1f} s")  # docs/reliability.md
    assert code == 1, errors[-3000:]
    stopped = [line for line in errors.splitlines() if line.startswith("run stopped:")]
    assert len(stopped) == 1 and re.search(cause, errors), errors[-3000:]
    assert "Traceback" not in errors
    deadline = time.monotonic() + 30
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left: {[(p.pid, p.name()) for p in left]}"
