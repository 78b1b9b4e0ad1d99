"""Local sweeps through the entry point: a failing point is recorded and the sweep goes on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gymrl.tracking.sweep import POINT_FILENAME, SUMMARY_FILENAME, SWEEP_FILENAME

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
        "+experiment=smoke_noncontiguous",  # 3 steps: the failing point meets a broken episode
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
    assert row.split("|")[4].strip() == "3", "the trained point's final step"
    # Each point is its own W&B run in the sweep's group, tagged with its swept value.
    (data,) = (tmp_path / "1" / "wandb").glob("offline-run-*/*.wandb")
    raw = data.read_bytes()
    for label in (f"smoke_noncontiguous-{tmp_path.name}", "truncate_noncontiguous_episodes=True"):
        assert label.encode() in raw, label


def slurm_task_env(rank: int) -> dict[str, str]:
    """What a submitit Slurm task sees, with launch/ray.sub in DRY_RUN mode (prints its steps)."""
    return {
        **os.environ,
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(rank),
        "SLURM_NTASKS": "16",
        "SLURM_JOB_NUM_NODES": "16",
        "DRY_RUN": "1",
        "DRY_RUN_NODES": " ".join(f"n{i}" for i in range(16)),
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_a_slurm_point_runs_through_ray_sub_on_its_allocation(tmp_path, rank):
    """The first task hands the point to launch/ray.sub (Ray head + 15 workers, then the recipe
    with the point's overrides into the point's folder); the other tasks only hold their nodes."""
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "-m",
            "+experiment=math_1p5b",
            "grpo.num_steps=2,3",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=slurm_task_env(rank),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if rank:
        assert done.returncode == 1  # no point ran here: the summary has them unfinished
        assert not list(tmp_path.glob("*/point.json")) and "ray start" not in done.stdout
        return
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("DRY_RUN: srun")]
    heads = [line for line in steps if "ray start --head" in line]
    workers = [line for line in steps if "ray start --address=" in line]
    recipes = [line for line in steps if "recipes/grpo.py" in line]
    assert len(heads) == 2 and len(workers) == 2 * 15 and len(recipes) == 2
    for number, recipe in enumerate(recipes):
        assert "cluster.ray_address=auto cluster.num_nodes=16" in recipe
        assert f"grpo.num_steps={number + 2}" in recipe
        assert f"run.output_dir={tmp_path / str(number)}" in recipe
        # The point's W&B labels travel with it (as ray.sub prints them, shell-quoted).
        assert f'logger.wandb.group=\\"math_qwen2p5_1p5b-{tmp_path.name}\\"' in recipe
        assert f'tags=\\[\\"math_1p5b\\"\\,\\"grpo.num_steps={number + 2}\\"\\]' in recipe
        assert point(tmp_path, number)["status"] == "completed"


@pytest.mark.slow
def test_the_submitit_local_launcher_runs_two_smoke_points_as_separate_jobs(tmp_path):
    """`hydra/launcher=submitit_local`: the Slurm launcher's local executor, one process per
    point (as one allocation per point on Slurm), both points trained and summarised."""
    done = sweep(
        tmp_path,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=20",
        "+experiment=smoke",
        "grpo.num_steps=1",
        "run.seed=0,1",
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Submitit 'local' sweep output dir" in done.stderr + done.stdout
    for number in (0, 1):
        record = point(tmp_path, number)
        assert record["status"] == "completed" and record["objective"] is not None
        assert f"run.seed={number}" in record["overrides"]
        (final,) = [json.loads(line) for line in (tmp_path / str(number) / "metrics.jsonl").open()]
        assert final["step"] == 1
    jobs = {path.parent.name for path in (tmp_path / ".submitit").glob("*/*_result.pkl")}
    assert len(jobs) == 2, "each point ran as its own submitit job"
    assert "| 1 | completed | 1 | 1 |" in (tmp_path / SUMMARY_FILENAME).read_text()


@pytest.mark.slow
def test_optuna_searches_the_smoke_experiment_for_the_best_objective(tmp_path):
    """`+experiment=search_smoke` with three one-step trials: every trial is a recorded point
    with its objective, and Optuna's best value is the best of them."""
    done = sweep(
        tmp_path,
        "+experiment=search_smoke",
        "hydra.sweeper.n_trials=3",
        "grpo.num_steps=1",
        "run.objective_last_steps=1",
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    keys = json.loads((tmp_path / SWEEP_FILENAME).read_text())["swept_keys"]
    assert keys == ["loss.kl_coef", "trainer.optimizer.lr"]
    trials = [point(tmp_path, number) for number in range(3)]
    assert all(t["status"] == "completed" for t in trials)
    learning_rates = {o for t in trials for o in t["overrides"] if o.startswith("trainer.")}
    assert len(learning_rates) == 3, "each trial tried its own learning rate"
    best = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert best.best_value == max(t["objective"] for t in trials)
