"""SIGTERM through the real entry point: the step in progress finishes, the last finished step is
checkpointed, everything closes, the exit status is 143, and `resume=true` continues from it.

Also checks the policy server's key (given through the environment) appears nowhere the run
writes: output folder (metrics.jsonl, Hydra's config, W&B files) and the run's own output.
One run of the smoke config plus a one-step resume: minutes on two cores, so `slow`.
"""

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gymrl.generation.server.api_key import API_KEY_ENV
from gymrl.run.checkpoint import latest_verified_checkpoint, verify_checkpoint
from tests.recipes.recipe_runs import (
    MARKER,
    logged_steps,
    marked_processes,
    recipe_command,
    wait_for_first_step,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STOP_DEADLINE_S = 240  # stop.deadline_s (120) + a checkpoint + closing every actor, on busy cores


def _command(out: Path, *overrides: str) -> list[str]:
    # Only the stop saves a checkpoint.
    return recipe_command(out, "+experiment=smoke", "checkpoint.every_n_steps=0", *overrides)


def test_sigterm_keeps_the_step_in_progress_and_resume_continues(tmp_path):
    marker, secret = uuid.uuid4().hex, f"key-{uuid.uuid4().hex}"
    env = {**os.environ, MARKER: marker, API_KEY_ENV: secret, "PYTHONPATH": str(ROOT)}
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    out = tmp_path / "run"
    with stdout.open("w") as out_file, stderr.open("w") as err_file:
        run = subprocess.Popen(
            _command(out, "grpo.num_steps=50"), cwd=ROOT, env=env, stdout=out_file, stderr=err_file
        )
        try:
            wait_for_first_step(run, out, stderr)
            time.sleep(2)  # inside a step (step 1 still logging to W&B, or step 2)
            signalled = time.monotonic()
            run.send_signal(signal.SIGTERM)
            code = run.wait(timeout=STOP_DEADLINE_S)
            stop_s = time.monotonic() - signalled
        finally:
            if run.poll() is None:
                run.kill()
    errors = stderr.read_text()
    assert code == 128 + signal.SIGTERM, errors[-3000:]
    print(f"SIGTERM to exit: {stop_s:.1f} s")  # docs/reliability.md quotes this

    # The step in progress finished, was logged and checkpointed; the checkpoint verifies.
    steps = logged_steps(out)
    assert steps == list(range(1, len(steps) + 1)), errors[-3000:]
    checkpoint, rejected = latest_verified_checkpoint(out / "checkpoints")
    assert rejected == [] and checkpoint == out / "checkpoints" / f"step_{steps[-1]}"
    verify_checkpoint(checkpoint)
    assert "run stopped by SIGTERM: stopping after the step" in errors
    assert f"saved a checkpoint of step {steps[-1]}" in errors
    assert "Traceback" not in errors

    # Nothing left running: Ray, its workers, the servers' threads die with their processes.
    deadline = time.monotonic() + 30
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left: {[(p.pid, p.name()) for p in left]}"

    resumed = subprocess.run(
        _command(out, "resume=true", f"grpo.num_steps={steps[-1] + 1}"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {steps[-1]}" in resumed.stdout
    assert logged_steps(out) == [*steps, steps[-1] + 1]

    # The key reached no file and no console, except the owner-only announcement a Gym
    # deployment reads it from.
    announcement = out / "policy_server.json"
    assert announcement.stat().st_mode & 0o077 == 0
    assert json.loads(announcement.read_text())["policy_api_key"] == secret
    written = [stdout, stderr, *(p for p in out.rglob("*") if p.is_file() and p != announcement)]
    leaks = [p for p in written if secret.encode() in p.read_bytes()]
    assert leaks == [] and secret not in resumed.stdout + resumed.stderr
