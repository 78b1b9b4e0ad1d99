"""Evaluate a policy on held-out rows: per agent mean reward with its standard error, pass@k,
failure and truncation rates and tokens; one JSON line per episode and a summary (docs/
evaluation.md). No trainer starts.

    python recipes/eval.py                                              # the starting weights
    python recipes/eval.py +experiment=learn eval.checkpoint=outputs/learn_seed0/checkpoints/step_12
    python recipes/eval.py +experiment=smoke eval.checkpoint=outputs/smoke   # newest verified step
    python recipes/eval.py eval.num_samples=8 eval.pass_at_k=[1,8] eval.temperature=0.7
    python recipes/eval.py +experiment=gym_example eval.checkpoint=...  # a launched Gym deployment
    python -m gymrl.report outputs/smoke/eval/start outputs/smoke/eval/step_3 -o compare.html

The same config tree as recipes/grpo.py: the experiment a run trained with gives the policy and
the agents, `eval.*` the rest. Validation comes first (exit 2 on a bad config, before torch or
Ray is imported); `dry_run=true` stops after it. The eval is `gymrl.recipes.evaluation.EvalRecipe`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gymrl.config.compose import register_schema_defaults, to_plain_dict
from gymrl.preflight.validate import validate_config
from nemo_gym_ext.config_errors import ConfigError

register_schema_defaults()


@hydra.main(config_path="../conf", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        config = validate_config(to_plain_dict(cfg))
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    evaluation = config.eval
    print(
        f"eval: {config.policy.name}, weights {evaluation.checkpoint or 'as policy.* names'}, "
        f"{evaluation.num_samples} samples per held-out row, pass@{evaluation.pass_at_k}, "
        f"env.source={config.env.source}",
        flush=True,
    )
    if config.dry_run:
        print("dry run: config valid, nothing started")
        return
    run_dir = Path(config.run.output_dir or HydraConfig.get().runtime.output_dir).resolve()
    from gymrl.recipes.evaluation import run_eval  # torch and ray: only once the config is valid

    sys.exit(run_eval(config, run_dir))


if __name__ == "__main__":
    # The run folder Hydra points at (outputs/<run.name>) may hold the training run evaluated
    # here: its .hydra/ must stay the training run's, so an eval writes none there.
    if not any(arg.startswith("hydra.output_subdir") for arg in sys.argv[1:]):
        sys.argv.append("hydra.output_subdir=null")
    main()
