"""One point of a Hydra multirun (`python recipes/grpo.py -m ...`), as `recipes/grpo.py` hands it
over: a point that fails is recorded in its folder (`gymrl.tracking.sweep.record_point`) and
returns NaN instead of exiting, so the sweep goes on to the next point and its summary lists
every point. Under the submitit Slurm launcher the point runs through launch/ray.sub in its own
allocation (`gymrl.cluster.slurm`); the allocation's other tasks only hold their nodes.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

from hydra.conf import HydraConf
from omegaconf import DictConfig, OmegaConf

from gymrl.cluster.slurm import run_on_allocation, slurm_task_rank
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.recipes.entry import RunFailed, objective, prepare, train
from gymrl.tracking.sweep import record_point


def run_sweep_point(cfg: DictConfig, hydra_cfg: HydraConf) -> float | None:
    """Run (or, on an allocation's other nodes, only hold) this point; its objective or NaN."""
    rank = slurm_task_rank()
    if rank:  # the allocation's other nodes: launch/ray.sub puts Ray workers on them
        return None
    point = Path(hydra_cfg.runtime.output_dir)
    output_dir = Path(OmegaConf.select(cfg, "run.output_dir") or point).resolve()
    overrides = list(hydra_cfg.overrides.task)
    try:
        config, output_dir = prepare(cfg, hydra_cfg, sweeping=True)
        if config.dry_run:
            value = None
        elif rank == 0:
            value = train_on_allocation(config, overrides, output_dir)
        else:
            value = train(config, output_dir)
    except Exception as error:  # any failure ends this point only; the sweep goes on
        if isinstance(error, RunFailed):
            message = str(error)
        else:  # unexpected: the traceback to the log, its last line to the summary
            traceback.print_exc()
            message = f"{type(error).__name__}: {error}"
        print(message, file=sys.stderr, flush=True)
        record_point(
            point, output_dir=output_dir, overrides=overrides, status="failed", error=message
        )
        return math.nan
    record_point(
        point, output_dir=output_dir, overrides=overrides, status="completed", objective=value
    )
    return value


def train_on_allocation(config: RecipeConfig, overrides: list[str], output_dir: Path) -> float:
    """The point as `launch/ray.sub` runs it (Ray on every node of this Slurm allocation), with
    this point's W&B labels passed on to that single run."""
    wandb = config.logger.wandb
    labels = [
        f"logger.wandb.{key}={json.dumps(value, separators=(',', ':'))}"
        for key, value in (
            ("group", wandb.group),
            ("job_type", wandb.job_type),
            ("tags", wandb.tags),
        )
    ]
    code = run_on_allocation([*overrides, *labels], output_dir)
    if code != 0:
        raise RunFailed(
            f"launch/ray.sub exited with status {code}; its log is the job's output under "
            "<sweep folder>/.submitit/",
            exit_code=code,
        )
    return objective(config, output_dir)
