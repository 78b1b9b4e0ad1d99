"""launch/ray.sub without Slurm: syntax, the dry-run plan, and the GPU wait against a stub `ray`.

The script runs its `main` only when executed, so a test can source it and call `wait_for_gpus`
with `RAY` pointing at a stub that prints `ray status` output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "ray.sub"
PHASE = re.compile(r"^\[ray\.sub (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\] phase: (.+)$")

_STATUS = """======== Autoscaler status ========
Node status
---------------------------------------------------------------
Active:
 1 node_0123

Resources
---------------------------------------------------------------
Usage:
 0.0/64.0 CPU
 0.0/{gpus}.0 GPU
 0B/100.00GiB memory

Demands:
 (no resource demands)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return env | extra


def _bash(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, env=_env(**env)
    )


@pytest.fixture
def stub_ray(tmp_path: Path):
    """A `ray` whose status reports 8 more GPUs at each call, up to `limit` (file-controlled)."""
    (tmp_path / "limit").write_text("16")
    (tmp_path / "calls").write_text("0")
    status = tmp_path / "status.txt"
    status.write_text(_STATUS)
    stub = tmp_path / "ray"
    stub.write_text(
        f"""#!/bin/bash
[[ "$1" == status && "$2" == --address=* ]] || exit 2
calls=$(( $(cat {tmp_path}/calls) + 1 )); echo $calls > {tmp_path}/calls
[[ $calls -ge 2 ]] || exit 1   # unreachable at first, as while the head starts
gpus=$(( (calls - 1) * 8 )); limit=$(cat {tmp_path}/limit)
(( gpus > limit )) && gpus=$limit
sed "s/{{gpus}}/$gpus/" {status}
"""
    )
    stub.chmod(0o755)
    return tmp_path


def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dry_run_prints_the_cluster_plan_and_forwards_overrides():
    result = subprocess.run(
        ["bash", str(SCRIPT), "+experiment=swe_bench_30b", "run.name=a b", "grpo.num_steps=3"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(DRY_RUN="1", DRY_RUN_NODES="n0 n1 n2", GPUS_PER_NODE="8", CPUS_PER_NODE="32"),
    )
    assert result.returncode == 0, result.stderr
    phases = [m.group(2) for line in result.stderr.splitlines() if (m := PHASE.match(line))]
    assert phases == [
        "start Ray head on n0",
        "start 2 Ray worker(s)",
        "wait for 24 GPUs",
        "run recipe",
        "teardown (exit code 0)",
    ]
    commands = [shlex.split(line.removeprefix("DRY_RUN: ")) for line in result.stdout.splitlines()]
    step = ["srun", "--overlap", "--nodes=1", "--ntasks=1"]
    resources = ["--gres=gpu:8", "--cpus-per-task=32"]
    head, *workers, recipe = commands
    assert head[:7] == [*step, "--nodelist=n0", *resources]
    assert head[7:10] == ["ray", "start", "--head"] and "--port=6379" in head
    assert [w[4] for w in workers] == ["--nodelist=n1", "--nodelist=n2"]
    assert all(
        w[7:] == ["ray", "start", "--address=n0:6379", "--num-gpus=8", "--num-cpus=32", "--block"]
        for w in workers
    )
    assert recipe[7:] == [
        "python",
        "recipes/grpo.py",
        "cluster.ray_address=auto",
        "cluster.num_nodes=3",
        "cluster.gpus_per_node=8",
        "+experiment=swe_bench_30b",
        "run.name=a b",
        "grpo.num_steps=3",
    ]


def test_container_image_goes_on_every_step():
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(
            DRY_RUN="1",
            DRY_RUN_NODES="n0",
            CONTAINER_IMAGE="nvcr.io/org/gym-grpo:1",
            CONTAINER_MOUNTS="/lustre:/lustre",
            REPO_DIR=str(SCRIPT.parents[1]),
        ),
    )
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        words = shlex.split(line.removeprefix("DRY_RUN: "))
        assert "--container-image=nvcr.io/org/gym-grpo:1" in words
        assert "--container-mounts=/lustre:/lustre" in words
        assert f"--container-workdir={SCRIPT.parents[1]}" in words


def test_wait_for_gpus_polls_until_all_are_registered(stub_ray):
    result = _bash(
        f"source {SCRIPT}; wait_for_gpus head:6379 16",
        RAY=str(stub_ray / "ray"),
        RAY_POLL_S="0.05",
        RAY_WAIT_TIMEOUT_S="30",
    )
    assert result.returncode == 0, result.stderr
    assert "waiting for Ray at head:6379: 0/16 GPUs registered" in result.stderr
    assert "waiting for Ray at head:6379: 8/16 GPUs registered" in result.stderr
    assert "Ray at head:6379 has 16/16 GPUs" in result.stderr
    assert (stub_ray / "calls").read_text().strip() == "3"


def test_wait_for_gpus_fails_at_its_deadline(stub_ray):
    (stub_ray / "limit").write_text("8")
    result = _bash(
        f"source {SCRIPT}; wait_for_gpus head:6379 16",
        RAY=str(stub_ray / "ray"),
        RAY_POLL_S="0.05",
        RAY_WAIT_TIMEOUT_S="1",
    )
    assert result.returncode == 1
    assert "has 8/16 GPUs after RAY_WAIT_TIMEOUT_S=1 s" in result.stderr


def test_outside_slurm_it_refuses_with_a_hint():
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert result.returncode == 1
    assert "not inside a Slurm job; submit with sbatch (or set DRY_RUN=1)" in result.stderr


def test_wait_for_gpus_fails_fast_when_a_ray_step_exits(stub_ray):
    (stub_ray / "limit").write_text("8")
    result = _bash(
        f"source {SCRIPT}; true & STEP_PIDS+=($!); STEP_NODES+=(n1); wait; "
        "wait_for_gpus head:6379 16",
        RAY=str(stub_ray / "ray"),
        RAY_POLL_S="0.05",
        RAY_WAIT_TIMEOUT_S="60",
    )
    assert result.returncode == 1
    assert "the Ray step on n1 exited" in result.stderr
