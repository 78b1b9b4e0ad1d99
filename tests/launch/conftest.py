"""The real local Slurm, started once for every test marked `slurm` and stopped after the last.

Its own folder and port (LOCAL_SLURM_PORT, default 26817 here): a cluster someone started with
launch/local_slurm/start.sh's defaults keeps running beside it."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.launch.local_slurm import LOCAL_SLURM, LocalSlurm


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("local_slurm")
    env = os.environ | {
        "LOCAL_SLURM_DIR": str(folder),
        "LOCAL_SLURM_PORT": os.environ.get("LOCAL_SLURM_PORT", "26817"),
    }
    started = subprocess.run(
        ["bash", str(LOCAL_SLURM / "start.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert started.returncode == 0, started.stderr
    yield LocalSlurm(folder / "slurm.conf")
    stopped = subprocess.run(
        ["bash", str(LOCAL_SLURM / "stop.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == 0, stopped.stderr
