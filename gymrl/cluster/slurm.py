"""A sweep point in its own Slurm allocation (Hydra's submitit launcher): Ray as launch/ray.sub.

`hydra/launcher=submitit_slurm` submits one job per point, with as many nodes as the point asks
for (`hydra.launcher.nodes`, one task per node), and calls the recipe's `main` in every task. The
first task hands the point to `launch/ray.sub`, the same script `sbatch` runs: it starts the Ray
head and one worker per node inside this allocation, waits for every GPU, runs the recipe on the
head as an ordinary single run into the point's folder, and tears Ray down. The other tasks only
hold their nodes; ray.sub's `srun --overlap` steps run on them. So a 16-node point and a 1-node
point take the same path, and what runs on the allocation is what `sbatch launch/ray.sub` runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import gymrl

REPO = Path(gymrl.__file__).resolve().parents[1]
RAY_SUB = REPO / "launch" / "ray.sub"


def slurm_task_rank() -> int | None:
    """This task's rank in a Slurm job that submitit started; None outside one."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    import submitit

    return submitit.JobEnvironment().global_rank


def ray_sub_command(task_overrides: list[str], point_dir: Path) -> list[str]:
    """`bash launch/ray.sub <the point's overrides>`, writing into the point's folder."""
    return [
        "bash",
        str(RAY_SUB),
        *task_overrides,
        f"run.output_dir={point_dir}",
        f"hydra.run.dir={point_dir}",
    ]


def run_on_allocation(task_overrides: list[str], point_dir: Path) -> int:
    """Run the point through launch/ray.sub in this allocation; its exit status. The wait is
    bounded by the allocation's time limit (`hydra.launcher.timeout_min`) and ray.sub's own
    deadlines."""
    command = ray_sub_command(task_overrides, point_dir)
    return subprocess.run(command, cwd=REPO, env={**os.environ, "REPO_DIR": str(REPO)}).returncode
