"""`run.*`: the run's name and output folder, its seed, the objective a sweep optimises and the
no-progress watchdog."""

from __future__ import annotations

from pydantic import Field

from gymrl.config.schema.base import Strict


class RunConfig(Strict):
    name: str = Field(description="Run name: the W&B run name and the output folder's name.")
    output_dir: str | None = Field(
        default=None,
        description="Where metrics.jsonl, checkpoints and W&B files go. null = Hydra's output "
        "directory of this job (outputs/<name> for a single run, one folder per job in a sweep).",
    )
    seed: int = Field(default=0, description="Seeds data order, sampling and initialisation.")
    objective: str = Field(
        default="train/reward/mean",
        description="The metric key (docs/metrics.md) whose mean over the last "
        "`objective_last_steps` logged steps the run returns to a Hydra sweeper (Optuna "
        "optimises it in the direction `hydra.sweeper.direction`); NaN when the run failed or "
        "never logged it, which Optuna records as a failed trial.",
    )
    objective_last_steps: int = Field(
        default=1, gt=0, description="Logged steps the objective averages over, from the end."
    )
    progress_timeout_s: float | None = Field(
        default=3600.0,
        gt=0,
        description="The no-progress watchdog: when no group of episodes reaches training (a "
        "group dropped because it cannot train does not count), no validation episode comes "
        "back and no training step ends for this long, the run stops and prints what each role "
        "was waiting on (its wait, that wait's deadline, how long it had waited). Set it above "
        "the longest quiet time of a healthy run: one group's episodes (env.rollout.run_timeout_s) "
        "and one step's training, refit, checkpoint and validation. One hour covers a 1.5B model "
        "on a few nodes; each experiment sets its own (conf/experiment/*.yaml). null = off (each "
        "wait keeps its own deadline).",
    )
