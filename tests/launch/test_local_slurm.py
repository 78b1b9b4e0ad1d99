"""launch/ray.sub through a real Slurm: two nodes on this host (launch/local_slurm/), one cluster
for the session (tests/launch/conftest.py).

* a two-node job: Ray's head on one node and a worker on the other, smoke trained to the end with
  the policy server (generation) on the second node and the trainer on the first, the refit
  between them after every step, checkpoints and metrics written, Ray torn down, every phase in
  the job log with its time;
* failing jobs (an invalid override; a Ray head that cannot start): the reason in the job log, a
  non-zero exit, no process left behind;
* a preemption: the signal Slurm's `--signal=B:TERM@<s>` sends, the checkpoint on it, the
  requeue, and the requeued job resuming in the same folder under the same W&B run and training
  the rows the uninterrupted two-node run trained, step by step (sync mode);
* a sweep through Hydra's submitit Slurm launcher: one allocation per point, a failing point
  isolated, the summary at the end.

The times these print (`-s`) are the ones docs/cluster.md and launch/README.md quote. Minutes on
two cores: marked `slurm`, run by `make test-slurm` (and `.ci/run`).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from gymrl.run.checkpoint import COMPLETE_MARKER
from gymrl.run.folder import RUN_FILENAME, TRAINED_ROWS_FILENAME
from gymrl.tracking.sweep import POINT_FILENAME, SUMMARY_FILENAME
from tests.launch.local_slurm import (
    LocalSlurm,
    first_time,
    job_fields,
    log_lines,
    now,
    phases,
    submit,
    wait_until,
    wait_until_ended,
)
from tests.recipes.recipe_runs import ROOT, marked_processes, read_metrics

pytestmark = pytest.mark.slurm

# Sync mode: every step trains the rows at the next positions of the row stream, so a resumed
# run trains the same rows at every step as one that never stopped (docs/reliability.md).
SMOKE = ("+experiment=smoke", "grpo.async_enabled=false")
JOB_TIMEOUT_S = 900
# A job's processes end with its steps; Slurm reaps them within a few seconds.
LEFTOVER_GRACE_S = 30


def _rows(run: Path) -> list[dict]:
    """trained_rows.jsonl: each step's rows."""
    return [json.loads(line) for line in (run / TRAINED_ROWS_FILENAME).read_text().splitlines()]


def _nothing_left(marker: str) -> None:
    """No process of the job is left: Ray's daemons and workers, the recipe, W&B's service."""
    wait_until(lambda: not marked_processes(marker), LEFTOVER_GRACE_S, "the job's processes ending")


@dataclass(frozen=True)
class TwoNodeRun:
    job_id: str
    out: Path
    exit_code: int
    submitted: datetime
    first_step: datetime
    # The Slurm node each Ray actor class ran on, as its processes' environment says.
    nodes_of: dict[str, set[str]]

    @property
    def log(self) -> Path:
        return self.out / f"job-{self.job_id}.out"

    @property
    def run(self) -> Path:
        return self.out / "run"


@pytest.fixture(scope="module")
def two_node_run(local_slurm: LocalSlurm, tmp_path_factory) -> TwoNodeRun:
    """`sbatch --nodes=2 launch/ray.sub +experiment=smoke` (sync), the policy server pinned to
    the second node and the trainer to the first; watched while it runs: when its first step
    ends, and on which node each actor's processes run (SLURMD_NODENAME, which the `ray start`
    step of that node passed to every process it started)."""
    out = tmp_path_factory.mktemp("two_nodes")
    marker = uuid.uuid4().hex
    submitted = now()
    job_id = submit(
        local_slurm,
        out,
        "--nodes=2",
        overrides=(
            *SMOKE,
            "+cluster.roles.policy_server.node_labels={slurm-node-index:'1'}",
            "+cluster.roles.trainer.node_labels={slurm-node-index:'0'}",
        ),
        env=local_slurm.env(marker),
    )
    rows = out / "run" / TRAINED_ROWS_FILENAME
    first_step: datetime | None = None
    nodes_of: dict[str, set[str]] = {}

    def watch() -> bool:
        nonlocal first_step
        if first_step is None and rows.exists():
            first_step = now()
        for process in marked_processes(marker):
            try:
                title, node = process.cmdline()[0], process.environ().get("SLURMD_NODENAME")
            except Exception:  # ended since it was listed
                continue
            if title.startswith("ray::") and node:
                actor = title.removeprefix("ray::").split(".")[0]
                nodes_of.setdefault(actor, set()).add(node)
        return job_fields(local_slurm, job_id)["JobState"] not in {"PENDING", "RUNNING"}

    wait_until(watch, JOB_TIMEOUT_S, f"two-node job {job_id} ending")
    exit_code = wait_until_ended(local_slurm, job_id, 60)
    assert first_step is not None, (out / f"job-{job_id}.out").read_text()[-5000:]
    _nothing_left(marker)
    return TwoNodeRun(job_id, out, exit_code, submitted, first_step, nodes_of)


def test_a_two_node_job_brings_ray_up_on_both_trains_and_tears_it_down(two_node_run):
    run, log = two_node_run, two_node_run.log
    assert run.exit_code == 0, log.read_text()[-5000:]
    assert phases(log) == [
        "start Ray head on n0",
        "start 1 Ray worker(s)",
        "wait for 2 node(s), 0 GPUs",
        "run recipe",
        "teardown (exit code 0)",
    ]
    messages = [message for _, message in log_lines(log)]
    assert any(m.endswith("has 1/1 nodes, 0/0 GPUs") for m in messages)
    assert any(m.endswith("has 2/2 nodes, 0/0 GPUs") for m in messages)
    (timings,) = [m for m in messages if m.startswith("timings: ")]
    assert "start Ray head on n0 " in timings and "run recipe " in timings

    assert [r["step"] for r in read_metrics(run.run)] == [1, 2, 3]
    assert [r["step"] for r in _rows(run.run)] == [1, 2, 3]
    assert (run.run / "checkpoints" / "step_2" / COMPLETE_MARKER).is_file()

    started = log_lines(log)[0][0]
    head_up = first_time(log, "Ray at ")
    workers_up = next(t for t, m in log_lines(log) if m.endswith("has 2/2 nodes, 0/0 GPUs"))
    recipe = first_time(log, "phase: run recipe")
    setup = re.search(r"policy server up ([\d.]+) s into setup", log.read_text())
    print(
        f"sbatch -> first step {(run.first_step - run.submitted).total_seconds():.1f} s: "
        f"queued {(started - run.submitted).total_seconds():.1f} s, Ray head "
        f"{(head_up - started).total_seconds():.1f} s, worker "
        f"{(workers_up - head_up).total_seconds():.1f} s, recipe start "
        f"{(recipe - workers_up).total_seconds():.1f} s, recipe to step 1 "
        f"{(run.first_step - recipe).total_seconds():.1f} s (policy server up "
        f"{setup.group(1) if setup else '?'} s into setup); {timings}"
    )


def test_generation_and_training_run_on_the_two_nodes_and_refit_between_them(
    local_slurm, two_node_run
):
    """The policy server (its torch engine) on the second node and the trainer on the first, as
    their node labels ask; the roles without labels (the Gym shard, the replay buffer) wherever
    Ray put them. The policy server is announced at its node's address, not loopback (the Gym
    shard's agents may call it from the other node), and the engine's weights follow the
    trainer's every step: each refit crossed between the two Ray nodes' object stores."""
    run = two_node_run
    assert run.exit_code == 0
    assert run.nodes_of["GenerationServer"] == {"n1"}
    assert run.nodes_of["PolicyTrainerActor"] == {"n0"}
    assert run.nodes_of["GymShard"] | run.nodes_of["ReplayBuffer"] <= {"n0", "n1"}
    print(f"nodes of each actor: {dict(sorted(run.nodes_of.items()))}")

    node = local_slurm.run("scontrol", "show", "node", "--oneliner", "n1")
    address = re.search(r"(?:^| )NodeAddr=(\S+)", node).group(1)
    announced = json.loads((run.run / "policy_server.json").read_text())["policy_base_url"]
    assert announced.startswith(f"http://{address}:"), announced
    for record in read_metrics(run.run):
        assert record["async/weight_version"] == record["step"]
        assert record["timing/refit_s"] > 0


@pytest.mark.parametrize("failure", ["invalid-override", "ray-head-cannot-start"])
def test_a_failing_job_ends_with_its_reason_in_the_log_and_leaves_nothing(
    local_slurm, tmp_path, failure
):
    """An override the config refuses (after Ray came up on both nodes: the recipe validates
    it), and a head whose GCS port another process holds (RAY_PORT given, so ray.sub does not
    pick a free one): the job fails with the reason in its log, its status non-zero, and every
    process it started gone."""
    marker = uuid.uuid4().hex
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        if failure == "invalid-override":
            nodes, overrides, extra = "--nodes=2", ("+experiment=smoke", "grpo.num_steps=0"), {}
            expected_code, reasons = 2, ["grpo.num_steps = 0", "recipe exited with code 2"]
        else:
            nodes, overrides = "--nodes=1", ("+experiment=smoke",)
            extra = {"RAY_PORT": str(taken.getsockname()[1])}
            expected_code = 1
            reasons = [
                "Failed to start GCS",
                "ERROR: the Ray step on n0 exited; see its output above",
                "ERROR: the Ray head did not come up",
            ]
        job_id = submit(
            local_slurm, tmp_path, nodes, overrides=overrides, env=local_slurm.env(marker, **extra)
        )
        code = wait_until_ended(local_slurm, job_id, JOB_TIMEOUT_S)
    log = (tmp_path / f"job-{job_id}.out").read_text()
    assert code == expected_code, log[-5000:]
    for reason in reasons:
        assert reason in log, log[-5000:]
    assert phases(tmp_path / f"job-{job_id}.out")[-1] == f"teardown (exit code {expected_code})"
    _nothing_left(marker)


def test_a_preempted_job_saves_on_the_signal_and_its_requeue_resumes_the_same_rows(
    local_slurm, tmp_path, two_node_run
):
    """`sbatch --requeue --signal=B:TERM@600`: Slurm sends SIGTERM to the batch shell alone 600 s
    before the time limit. Here the same signal is sent at once after step 1, `scancel --batch
    --signal=TERM` (Slurm checks time limits about once a minute, so waiting for it would cost
    up to a minute of CI). ray.sub passes it to the recipe, which finishes its step, saves it
    and exits 143; ray.sub requeues the job, and the requeued run (resume=true) continues in the
    same folder under the same W&B run. Only the signal saves (`checkpoint.every_n_steps=0`).
    Slurm holds a requeued batch job for two minutes (its begin time); the test lets it start
    at once (`scontrol update StartTime=now`), as an operator may.

    Rows, step by step, equal the uninterrupted two-node run's (sync mode). Losses are not
    compared: generation is not bit-exact between any two runs (docs/reliability.md)."""
    marker = uuid.uuid4().hex
    run = tmp_path / "run"
    submitted = now()
    job_id = submit(
        local_slurm,
        tmp_path,
        "--nodes=1",
        "--requeue",
        "--signal=B:TERM@600",
        "--time=30",
        overrides=(*SMOKE, "checkpoint.every_n_steps=0"),
        env=local_slurm.env(marker),
    )
    log = tmp_path / f"job-{job_id}.out"
    wait_until(lambda: (run / TRAINED_ROWS_FILENAME).exists(), JOB_TIMEOUT_S, "step 1")
    first_step = now()
    wandb_id = json.loads((run / RUN_FILENAME).read_text())["wandb_run_id"]
    local_slurm.run("scancel", "--batch", "--signal=TERM", job_id)

    fields = wait_until(
        lambda: (f := job_fields(local_slurm, job_id))["JobState"] != "RUNNING" and f,
        300,
        "the stopped job leaving RUNNING",
    )
    assert fields["JobState"] == "PENDING" and fields["Restarts"] == "1", log.read_text()[-5000:]
    held = (datetime.fromisoformat(fields["StartTime"]) - datetime.now()).total_seconds()
    local_slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    released = now()
    steps_before = len(_rows(run))
    resumed_first: list[datetime] = []

    def resumed_step_or_end() -> bool:
        if not resumed_first and len(_rows(run)) > steps_before:
            resumed_first.append(now())
        return job_fields(local_slurm, job_id)["JobState"] not in {"PENDING", "RUNNING"}

    wait_until(resumed_step_or_end, JOB_TIMEOUT_S, "the requeued job ending")
    code = wait_until_ended(local_slurm, job_id, 60)
    text = log.read_text()
    assert code == 0, text[-5000:]

    # The log: when the signal came, what was saved, the requeue, the resume.
    (saved,) = re.findall(r"saved a checkpoint of step (\d+) in [\d.]+ s", text)
    step = int(saved)
    assert "run stopped by SIGTERM: stopping after the step" in text
    assert "recipe exited with code 143" in text
    assert f"restart 1 of job {job_id}: the recipe resumes (resume=true)" in text
    assert f"resumed from {run}/checkpoints/step_{step} at step {step}" in text
    signalled = first_time(log, "received SIGTERM")
    assert "passed it to the recipe (pid" in text

    # Same folder, same W&B run: the requeued run's W&B files are under the first run's id.
    assert json.loads((run / RUN_FILENAME).read_text())["wandb_run_id"] == wandb_id
    runs = {path.name.rpartition("-")[2] for path in (run / "wandb").glob("offline-run-*")}
    assert runs == {wandb_id}

    # Step by step the rows of the run that never stopped; each step once.
    assert _rows(run) == _rows(two_node_run.run)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    _nothing_left(marker)

    checkpoint = run / "checkpoints" / f"step_{step}" / COMPLETE_MARKER
    saved_at = datetime.fromtimestamp(checkpoint.stat().st_mtime).astimezone()
    exited = first_time(log, "recipe exited with code 143")
    requeued = first_time(log, "requeueing job")
    restarted = next(
        t for t, m in log_lines(log) if m.startswith(f"job {job_id}:") and t > requeued
    )
    print(
        f"submit -> step 1 {(first_step - submitted).total_seconds():.1f} s; signal -> "
        f"checkpoint of step {step} saved {(saved_at - signalled).total_seconds():.1f} s, -> "
        f"recipe exited {(exited - signalled).total_seconds():.1f} s, -> requeued "
        f"{(requeued - signalled).total_seconds():.1f} s; Slurm's hold {held:.0f} s (released); "
        f"release -> job restarted {(restarted - released).total_seconds():.1f} s, -> resumed "
        f"first step {(resumed_first[0] - released).total_seconds():.1f} s"
    )


def test_a_slurm_sweep_runs_each_point_in_its_own_allocation_and_isolates_a_failed_one(
    local_slurm, tmp_path
):
    """`python recipes/grpo.py -m hydra/launcher=submitit_slurm`: one Slurm job per point
    (an array task each), the trained point through launch/ray.sub inside its allocation, the
    failing point (a value the config refuses) failed in its own, the sweep's summary listing
    both, the sweep's status 1. Slurm has no accounting database here, so submitit's `sacct`
    polls fail and it reads each point's result file instead (warnings in its output)."""
    marker = uuid.uuid4().hex
    started = now()
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.nodes=1",
            "hydra.launcher.timeout_min=20",
            "+experiment=smoke",
            "grpo.num_steps=1,0",
            "logger.progress_bar=false",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=local_slurm.env(marker),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    took = (now() - started).total_seconds()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-5000:]
    trained, failed = (json.loads((tmp_path / n / POINT_FILENAME).read_text()) for n in "01")
    assert trained["status"] == "completed" and trained["objective"] is not None
    assert failed["status"] == "failed" and "grpo.num_steps = 0" in failed["error"]
    assert [r["step"] for r in read_metrics(tmp_path / "0")] == [1]
    summary = (tmp_path / SUMMARY_FILENAME).read_text()
    assert "| 0 | completed | 1 | 1 |" in summary and "| 1 | failed | 0 |" in summary

    # One allocation per point: each ran as its own array task, the trained one through ray.sub.
    tasks = sorted(path.name for path in (tmp_path / ".submitit").glob("*_[01]"))
    assert [task.rpartition("_")[2] for task in tasks] == ["0", "1"]
    (point_log,) = (tmp_path / ".submitit" / tasks[0]).glob("*_log.err")
    head, *rest = phases(point_log)
    assert re.fullmatch(r"start Ray head on n[01]", head), head
    assert rest == [
        "start 0 Ray worker(s)",
        "wait for 1 node(s), 0 GPUs",
        "run recipe",
        "teardown (exit code 0)",
    ]
    (failed_log,) = (tmp_path / ".submitit" / tasks[1]).glob("*_log.err")
    assert "phase:" not in failed_log.read_text()  # refused before ray.sub started anything
    _nothing_left(marker)
    print(f"sweep of 2 points on Slurm to its summary: {took:.1f} s")
