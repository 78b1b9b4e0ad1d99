"""Local sweeps through the entry point: a failing point is recorded and the sweep goes on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gymrl.sweep import POINT_FILENAME, SUMMARY_FILENAME, SWEEP_FILENAME

ROOT = Path(__file__).resolve().parents[2]


def sweep(tmp_path: Path, *overrides: str, timeout: int):
    return subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "-m",
            *overrides,
            "logger.progress_bar=false",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def point(tmp_path: Path, number: int) -> dict:
    return json.loads((tmp_path / str(number) / POINT_FILENAME).read_text())


def test_an_invalid_point_is_recorded_and_the_sweep_still_runs_the_next(tmp_path):
    """Dry runs: seconds. The invalid point comes first; the one after it still runs."""
    done = sweep(tmp_path, "+experiment=smoke", "dry_run=true", "grpo.num_steps=0,2", timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert json.loads((tmp_path / SWEEP_FILENAME).read_text()) == {"swept_keys": ["grpo.num_steps"]}
    assert point(tmp_path, 0)["status"] == "failed"
    assert "grpo.num_steps = 0" in point(tmp_path, 0)["error"]
    assert point(tmp_path, 1)["status"] == "completed"
    summary = (tmp_path / SUMMARY_FILENAME).read_text()
    assert "| 0 | failed | 0 |" in summary and "| 1 | completed | 2 |" in summary
    assert "| 1 | completed | 2 |" in done.stdout
    assert "sweep failed: 1 of 2 point(s) did not complete (point 0)" in done.stderr


@pytest.mark.slow
def test_a_point_that_stops_mid_run_is_recorded_and_the_other_trains(tmp_path):
    """Agents re-tokenise earlier turns: without truncation the point stops with the contiguity
    error, with it the point trains; the summary has both, with the final metrics."""
    done = sweep(
        tmp_path,
        "+experiment=smoke_noncontiguous",
        "grpo.num_steps=1",
        "env.nemo_gym.truncate_noncontiguous_episodes=false,true",
        timeout=900,
    )
    assert done.returncode == 1, done.stderr[-5000:]
    failed, trained = point(tmp_path, 0), point(tmp_path, 1)
    assert failed["status"] == "failed"
    assert failed["error"].startswith("run stopped: NonContiguousEpisodeError")
    assert trained["status"] == "completed" and trained["objective"] is not None
    summary = (tmp_path / SUMMARY_FILENAME).read_text()
    assert "| 0 | failed | False |" in summary  # Hydra writes a job's booleans capitalised
    row = next(line for line in summary.splitlines() if line.startswith("| 1 | completed | True |"))
    assert row.split("|")[4].strip() == "1", "the trained point's final step"
    # Each point is its own W&B run in the sweep's group, tagged with its swept value.
    (data,) = (tmp_path / "1" / "wandb").glob("offline-run-*/*.wandb")
    raw = data.read_bytes()
    for label in (f"smoke_noncontiguous-{tmp_path.name}", "truncate_noncontiguous_episodes=True"):
        assert label.encode() in raw, label
