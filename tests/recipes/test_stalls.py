"""Stalls through the real entry point (docs/reliability.md, "Stalls"): a run whose rollout
collection stops making progress ends with a message that names each role's wait, instead of
idling until the longest deadline. Minutes per case on two cores, so `slow`."""

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.recipes.recipe_runs import (
    MARKER,
    marked_processes,
    read_metrics,
    recipe_command,
    wait_for_first_step,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROGRESS_TIMEOUT_S = 20


def test_a_frozen_gym_shard_trips_the_watchdog_naming_what_each_role_waited_on(tmp_path):
    """After the first step the Gym shard's process is frozen (SIGSTOP: a hung collector, a
    stuck node), so no group comes back. Every wait alone is far from its deadline (episodes
    600 s, the batch 1800 s); the watchdog stops the run after run.progress_timeout_s, naming
    the trainer loop's wait for the step's groups and the producer's wait for its groups."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "run"
    command = recipe_command(
        out,
        "+experiment=smoke",
        "grpo.num_steps=50",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "checkpoint.every_n_steps=0",
        f"run.progress_timeout_s={PROGRESS_TIMEOUT_S}",
    )
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err_file:
        run = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err_file
        )
        try:
            wait_for_first_step(run, out, stderr)
            (shard,) = [
                p for p in marked_processes(marker) if "ray::GymShard" in " ".join(p.cmdline())
            ]
            shard.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            code = run.wait(timeout=PROGRESS_TIMEOUT_S + 240)
            stop_s = time.monotonic() - frozen
        finally:
            if run.poll() is None:
                run.kill()
    errors = stderr.read_text()
    print(f"GymShard frozen -> exit {code} after {stop_s:.1f} s")  # docs/reliability.md
    assert code == 1, errors[-3000:]
    (stopped,) = [line for line in errors.splitlines() if line.startswith("run stopped:")]
    assert stopped.startswith("run stopped: NoProgressError: no group of episodes reached training")
    assert f"run.progress_timeout_s={PROGRESS_TIMEOUT_S}" in stopped
    assert "trainer loop: waiting for step " in stopped, stopped
    assert "rollout-producer: waiting for " in stopped, stopped
    assert "Traceback" not in errors
    deadline = time.monotonic() + 60
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left: {[(p.pid, p.name()) for p in left]}"


@pytest.mark.parametrize("async_enabled", [False, True], ids=["sync", "async"])
def test_a_run_longer_than_its_data_goes_on_into_the_next_pass(tmp_path, async_enabled):
    """Two rows per agent (four in all) and 3 steps of 4 prompts: every step after the first is
    a further pass over the data (reshuffled by seed, gymrl/experience/rows.py); nothing waits
    for a collector that was never restarted. Sync and async."""
    started = time.monotonic()
    done = subprocess.run(
        recipe_command(
            tmp_path,
            "+experiment=smoke",
            "env.data.num_builtin_rows_per_agent=2",
            "grpo.num_prompts_per_step=4",
            f"grpo.async_enabled={str(async_enabled).lower()}",
            "grpo.val_period=0",
            "grpo.val_at_end=false",
            "checkpoint.every_n_steps=0",
        ),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    mode = "async" if async_enabled else "sync"
    print(f"3 passes over 4 rows ({mode}): {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2, 3]
