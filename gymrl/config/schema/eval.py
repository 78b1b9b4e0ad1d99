"""`eval.*`: the settings of `recipes/eval.py` (docs/evaluation.md)."""

from __future__ import annotations

from pydantic import Field

from gymrl.config.schema.base import Strict
from nemo_gym_ext.wire import MAX_TEMPERATURE


class EvalConfig(Strict):
    """`recipes/eval.py`: held-out rows, `num_samples` episodes each, through the roles and the
    pass validation uses (`gymrl.experience.held_out`); no trainer starts. docs/evaluation.md."""

    checkpoint: str | None = Field(
        default=None,
        description="Weights to evaluate: a torch trainer checkpoint folder (<run>/checkpoints/"
        "step_<n>), a run's checkpoints/ folder or a run folder (the newest checkpoint there "
        "that passes its manifest). The model is built from policy.* (the run's policy), then "
        "given the checkpoint's weights. null = the weights policy.* names (the starting "
        "weights, or any Hugging Face folder with policy.source=pretrained policy.path=...).",
    )
    num_samples: int = Field(
        default=4, gt=0, description="Episodes per held-out row (n of the pass@k estimator)."
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature of eval episodes; 0 = greedy (then num_samples must "
        "be 1). null = generation.sampling.temperature, the policy's training sampling; top-p "
        "is generation.sampling.top_p.",
    )
    pass_at_k: list[int] = Field(
        default=[1, 4],
        min_length=1,
        description="The k of each pass@k reported per agent (unbiased estimator over "
        "num_samples episodes per row); every k at most num_samples.",
    )
    success_threshold: float = Field(
        default=1.0,
        description="An episode counts as a success for pass@k when its reward is at least this "
        "(1.0: only fully solved tasks; the built-in guess_number pays partial credit below 1).",
    )
    timeout_s: float = Field(
        default=3600.0, gt=0, description="Deadline of the whole evaluation pass."
    )
    output_dir: str | None = Field(
        default=None,
        description="Where episodes.jsonl and summary.json go (refused if it already holds an "
        "eval). null = <run folder>/eval/<step_<n>, or start for the starting weights>, the run "
        "folder being run.output_dir or Hydra's outputs/<run.name>.",
    )
    transcripts: bool = Field(
        default=False,
        description="Also keep each episode's output items (messages, tool calls and outputs, "
        "without token ids) in its episodes.jsonl record.",
    )
    wandb: bool = Field(
        default=False,
        description="Also log the summary under eval/ to a W&B run (logger.wandb settings, its "
        "files in the eval folder) at the checkpoint's step.",
    )
