"""Async GRPO for LLM agents on NeMo-Gym-style multi-turn tool-use environments.

    python recipes/grpo.py                                        # embedded CPU run (SmolLM2-135M)
    python recipes/grpo.py +experiment=smoke                      # tiny model, 3 steps, < 2 min
    python recipes/grpo.py +experiment=smoke_noncontiguous        # truncation of broken episodes
    python recipes/grpo.py +experiment=swe_bench_30b dry_run=true # the 16-node plan, validated
    python recipes/grpo.py -m +experiment=truncation_ablation     # a Hydra multirun sweep

Hydra composes conf/ over the schema's defaults (`--cfg job` shows the result); the first line of
`main` validates the whole tree into a typed `RecipeConfig` (gymrl/config/schema.py), reporting
every problem at once. Nothing starts before that: a bad config fails in a second, not after the
cluster came up. Then the run is `GRPORecipe` (gymrl/train.py) in three verbs: setup, train, and
cleanup, which always runs and closes whatever setup started. SIGINT and SIGTERM stop it cleanly
(gymrl/stop.py); the exit status is then 128 + the signal's number.

In a multirun (`-m`) each point is one call of `main`: a point that fails is recorded in its
folder (gymrl/sweep.py) and returns NaN instead of exiting, so the sweep goes on to the next point
and its summary lists every point. A point returns its objective (`run.objective`) to the sweeper.
Under the submitit Slurm launcher a point runs through launch/ray.sub in its own allocation
(gymrl/allocation.py).
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import hydra
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gymrl.allocation import run_on_allocation, slurm_task_rank
from gymrl.config.compose import register_schema_defaults, to_plain_dict
from gymrl.config.plan import render_plan
from gymrl.config.schema import RecipeConfig
from gymrl.config.validate import validate_config
from gymrl.metrics_logger import METRICS_FILENAME
from gymrl.plot import read_records
from gymrl.sweep import record_point, run_labels
from nemo_gym_ext.config import ConfigError

register_schema_defaults()  # conf/ builds on the schema's defaults; Hydra composes in main()


class RunFailed(Exception):
    """The run ended with a message a user can act on, and the process's exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        try:
            config, output_dir = prepare(cfg, hydra_cfg, sweeping=False)
            return None if config.dry_run else train(config, output_dir)
        except RunFailed as failure:
            print(failure, file=sys.stderr)
            sys.exit(failure.exit_code)
    rank = slurm_task_rank()
    if rank:  # the allocation's other nodes: launch/ray.sub puts Ray workers on them
        return None
    point = Path(hydra_cfg.runtime.output_dir)
    output_dir = Path(OmegaConf.select(cfg, "run.output_dir") or point).resolve()
    overrides = list(hydra_cfg.overrides.task)
    try:
        config, output_dir = prepare(cfg, hydra_cfg, sweeping=True)
        if config.dry_run:
            objective = None
        elif rank == 0:
            objective = train_on_allocation(config, overrides, output_dir)
        else:
            objective = train(config, output_dir)
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
        point, output_dir=output_dir, overrides=overrides, status="completed", objective=objective
    )
    return objective


def prepare(cfg: DictConfig, hydra_cfg: HydraConf, *, sweeping: bool) -> tuple[RecipeConfig, Path]:
    """The validated config (with its W&B labels) and the run's folder; prints the plan."""
    try:
        config = validate_config(to_plain_dict(cfg))
    except ConfigError as error:
        raise RunFailed(str(error), exit_code=2) from None
    config = run_labels(config, hydra_cfg, sweeping=sweeping)
    output_dir = Path(config.run.output_dir or hydra_cfg.runtime.output_dir).resolve()
    print(render_plan(config, str(output_dir)), flush=True)
    if config.dry_run:
        print("dry run: config valid, nothing started")
    return config, output_dir


def train(config: RecipeConfig, output_dir: Path) -> float:
    """Set up, train and clean up; the run's objective."""
    from gymrl.stop import StopRequested, stop_request_behind  # torch and ray: real runs only
    from gymrl.train import RUN_STOPPING_ERRORS, GRPORecipe

    recipe = GRPORecipe(config, output_dir)
    # SIGINT/SIGTERM end the run through `StopRequested`: the step finishes (or is abandoned),
    # the last finished step is saved, cleanup closes everything, the status is 128 + signal.
    recipe.install_stop_signals()
    try:
        recipe.setup()
        recipe.train()
    except (StopRequested, SystemError) as error:
        stop = stop_request_behind(error)
        if stop is None:
            raise
        kept = recipe.checkpoint_on_stop()
        print(f"run stopped by {stop}; {kept}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except RUN_STOPPING_ERRORS as error:
        raise RunFailed(f"run stopped: {type(error).__name__}: {error}", exit_code=1) from None
    finally:
        recipe.cleanup()
    return objective(config, output_dir)


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


def objective(config: RecipeConfig, output_dir: Path) -> float:
    """The mean of `run.objective` over the last `run.objective_last_steps` logged steps."""
    key = config.run.objective
    metrics = output_dir / METRICS_FILENAME
    records = read_records(metrics) if metrics.is_file() else []
    values = [r[key] for r in records if r.get(key) is not None]
    if not values:
        print(f"warning: run.objective={key!r} was never logged; the objective is NaN", flush=True)
        return math.nan
    last = values[-config.run.objective_last_steps :]
    return sum(last) / len(last)


if __name__ == "__main__":
    main()
