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
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gymrl.config.compose import register_schema_defaults, to_plain_dict
from gymrl.config.plan import render_plan
from gymrl.config.validate import validate_config
from nemo_gym_ext.config import ConfigError

register_schema_defaults()  # conf/ builds on the schema's defaults; Hydra composes in main()


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        config = validate_config(to_plain_dict(cfg))
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    output_dir = Path(config.run.output_dir or HydraConfig.get().runtime.output_dir).resolve()
    print(render_plan(config, str(output_dir)), flush=True)
    if config.dry_run:
        print("dry run: config valid, nothing started")
        return
    from gymrl.stop import StopRequested  # torch and ray: real runs only
    from gymrl.train import RUN_STOPPING_ERRORS, GRPORecipe

    recipe = GRPORecipe(config, output_dir)
    # SIGINT/SIGTERM end the run through `StopRequested`: the step finishes (or is abandoned),
    # the last finished step is saved, cleanup closes everything, the status is 128 + signal.
    recipe.install_stop_signals()
    try:
        recipe.setup()
        recipe.train()
    except StopRequested as stop:
        kept = recipe.checkpoint_on_stop()
        print(f"run stopped by {stop}; {kept}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except RUN_STOPPING_ERRORS as error:
        print(f"run stopped: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(1)
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    main()
