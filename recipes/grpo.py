"""Async GRPO for LLM agents on NeMo-Gym-style multi-turn tool-use environments.

    python recipes/grpo.py                                        # embedded CPU run (SmolLM2-135M)
    python recipes/grpo.py +experiment=smoke                      # tiny model, 3 steps, < 2 min
    python recipes/grpo.py +experiment=smoke_noncontiguous        # truncation of broken episodes
    python recipes/grpo.py +experiment=swe_bench_30b dry_run=true # the 16-node plan, validated
    python recipes/grpo.py -m +experiment=truncation_ablation     # a Hydra multirun sweep

Hydra composes conf/ over the schema's defaults (`--cfg job` shows the result); the first thing
`main` does is validate the whole tree into a typed `RecipeConfig` (gymrl/config/schema/),
reporting every problem at once. Nothing starts before that: a bad config fails in a second, not
after the cluster came up. Then the run is `GRPORecipe` (gymrl/recipes/training.py) in three verbs:
setup, train, and cleanup, which always runs and closes whatever setup started. SIGINT and
SIGTERM stop it cleanly (gymrl/run/stop.py); the exit status is then 128 + the signal's number.
In a multirun (`-m`) each call of `main` is one point (gymrl/recipes/sweep_point.py).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gymrl.config.compose import register_schema_defaults
from gymrl.recipes.entry import RunFailed, prepare, train
from gymrl.recipes.sweep_point import run_sweep_point

register_schema_defaults()  # conf/ builds on the schema's defaults; Hydra composes in main()


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return run_sweep_point(cfg, hydra_cfg)
    try:
        config, output_dir = prepare(cfg, hydra_cfg, sweeping=False)
        return None if config.dry_run else train(config, output_dir)
    except RunFailed as failure:
        print(failure, file=sys.stderr)
        sys.exit(failure.exit_code)


if __name__ == "__main__":
    main()
