"""What `recipes/grpo.py` does with a composed config, torch- and Ray-free until a run starts:
validate it and print the plan (`prepare`), run it (`train`, which imports the recipe class only
then, so a dry run imports neither torch, Ray nor matplotlib), and say how well it did
(`objective`, what a sweeper optimises).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

from hydra.conf import HydraConf
from omegaconf import DictConfig

from gymrl.config.compose import to_plain_dict
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.preflight.plan import render_plan
from gymrl.preflight.validate import validate_config
from gymrl.preflight.venvs import missing_venvs, render_missing
from gymrl.run.folder import METRICS_FILENAME
from gymrl.tracking.records import read_records
from gymrl.tracking.sweep import run_labels
from nemo_gym_ext.config_errors import ConfigError

log = logging.getLogger(__name__)


class RunFailed(Exception):
    """The run ended with a message a user can act on, and the process's exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def prepare(cfg: DictConfig, hydra_cfg: HydraConf, *, sweeping: bool) -> tuple[RecipeConfig, Path]:
    """The validated config (with its W&B labels) and the run's folder; prints the plan. A venv
    the run needs on this machine that `make` has not made is named with its target: by a dry run,
    which a config that is valid elsewhere still passes, and by a run, which stops here."""
    try:
        config = validate_config(to_plain_dict(cfg))
    except ConfigError as error:
        raise RunFailed(str(error), exit_code=2) from None
    config = run_labels(config, hydra_cfg, sweeping=sweeping)
    output_dir = Path(config.run.output_dir or hydra_cfg.runtime.output_dir).resolve()
    print(render_plan(config, str(output_dir)), flush=True)
    missing = missing_venvs(config)
    if config.dry_run:
        if missing:
            print(render_missing(missing))
        print("dry run: config valid, nothing started")
    elif missing:
        raise RunFailed(f"run not started: {render_missing(missing)}", exit_code=2)
    return config, output_dir


def train(config: RecipeConfig, output_dir: Path) -> float:
    """Set up, train and clean up; the run's objective."""
    # torch and ray: imported by a real run only
    from gymrl.recipes.stopping_errors import RUN_STOPPING_ERRORS
    from gymrl.recipes.training import GRPORecipe
    from gymrl.run.stop import StopRequested, stop_request_behind

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


def objective(config: RecipeConfig, output_dir: Path) -> float:
    """The mean of `run.objective` over the last `run.objective_last_steps` logged steps."""
    key = config.run.objective
    metrics = output_dir / METRICS_FILENAME
    records = read_records(metrics) if metrics.is_file() else []
    values = [r[key] for r in records if r.get(key) is not None]
    if not values:
        log.warning(f"run.objective={key!r} was never logged; the objective is NaN")
        return math.nan
    last = values[-config.run.objective_last_steps :]
    return sum(last) / len(last)
