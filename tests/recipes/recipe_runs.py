"""A recipe run in a subprocess, as the tests start and watch it: the command (`python
recipes/grpo.py` run as a user runs it, its output in one folder), its metrics, the steps it has
logged so far, and every process it started (found by a marker in their environment, which Ray
workers inherit), so a test can tell that nothing is left behind."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
# The environment variable a test sets to a fresh value for the run it starts.
MARKER = "GYMRL_RUN_UNDER_TEST"


def recipe_command(out: Path, *overrides: str) -> list[str]:
    """`recipes/grpo.py` with `overrides`, run from the repository root: the run folder and Hydra's
    are `out`, and the progress bar is off (its redraws would fill the captured stderr)."""
    return [
        sys.executable,
        "recipes/grpo.py",
        *overrides,
        f"run.output_dir={out}",
        f"hydra.run.dir={out}",
        "logger.progress_bar=false",
    ]


def run_recipe(
    out: Path, *overrides: str, timeout: int = 300, this_checkout_first: bool = False
) -> subprocess.CompletedProcess[str]:
    """The run of `recipe_command` to its end, its output captured. `this_checkout_first`: this
    checkout's code first on PYTHONPATH, whichever checkout the editable install points at, for
    runs whose roles start in venvs of their own (Ray's workers inherit the path)."""
    env = None
    if this_checkout_first:
        path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, path))}
    return subprocess.run(
        recipe_command(out, *overrides),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(out: Path) -> list[dict]:
    """Every record of `out/metrics.jsonl`, once the run has ended."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged_steps(out: Path) -> list[int]:
    """Steps in `out/metrics.jsonl`; the last line may be half written while the run goes on."""
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries `MARKER=marker`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def wait_for_first_step(run: subprocess.Popen, out: Path, stderr: Path, timeout_s: float = 600):
    """Return once the run in `out` has logged a step; fail with its stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not logged_steps(out):
        assert run.poll() is None, stderr.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step finished within {timeout_s:.0f} s"
        time.sleep(0.5)
