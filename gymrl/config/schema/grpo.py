"""`grpo.*` (conf/grpo.yaml): steps and group sizes, asynchrony, validation, dynamic sampling and
the first step's trainer-engine parity gate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gymrl.config.schema.base import Strict
from nemo_gym_ext.wire import MAX_TEMPERATURE


class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling: a group whose episodes all got the same reward has zero
    advantages and teaches nothing, so the producer drops it and runs another row instead."""

    enabled: bool = Field(
        default=False,
        description="Drop groups without reward variance (after the episode rules' overlong "
        "penalty) before they reach a step, and run further rows in their place. Off by "
        "default: on +experiment=learn (3 seeds) it did not raise the final validation reward "
        "and cost a third of the rise per training minute (benchmarks/README.md).",
    )
    max_dropped_groups_per_step: int = Field(
        default=8,
        ge=0,
        description="The over-sampling budget: groups dropped between two trainer steps (two "
        "refits), over every agent; once it is spent, groups without variance go to the step "
        "as they are, so a step never waits on rows that keep coming back uniform.",
    )


class ParityToleranceConfig(Strict):
    """Largest trainer-engine disagreement accepted at the first step, for one compute dtype."""

    logprob_diff_mean: float = Field(
        gt=0, description="Mean |trainer - engine| log-probability per generated token."
    )
    logprob_diff_max: float = Field(
        gt=0, description="Largest |trainer - engine| log-probability of any generated token."
    )
    ratio_std: float = Field(
        gt=0, description="Standard deviation of the per-token importance ratio."
    )


class ParityGateConfig(Strict):
    """At the first step of a run, engine and trainer hold the same weights, so their
    log-probabilities of the sampled tokens differ only by kernels and precision; a larger gap
    is a bug (a wrong temperature, template, refit or tokenizer) that would bias every step."""

    enabled: bool = Field(default=True, description="Check the first step; false skips it.")
    on_failure: Literal["stop", "warn"] = Field(
        default="stop",
        description="stop: end the run naming the agent and the figures; warn: print that and "
        "go on (parity/passed logs 0).",
    )
    float32: ParityToleranceConfig = Field(
        default=ParityToleranceConfig(
            logprob_diff_mean=1e-3, logprob_diff_max=2e-2, ratio_std=5e-3
        ),
        description="Tolerance when both sides compute in float32.",
    )
    bfloat16: ParityToleranceConfig = Field(
        default=ParityToleranceConfig(logprob_diff_mean=5e-2, logprob_diff_max=1.0, ratio_std=0.15),
        description="Tolerance when either side computes in bfloat16 (policy.dtype, or the "
        "trainer's resolved policy.compute_dtype).",
    )


class GRPOConfig(Strict):
    num_steps: int = Field(gt=0, description="Optimizer steps of the run.")
    num_prompts_per_step: int = Field(gt=0, description="GRPO groups per step.")
    num_generations_per_prompt: int = Field(gt=1, description="Episodes per group (group size).")
    async_enabled: bool = Field(
        default=True,
        description="Generate the next steps' episodes while training (true) or alternate.",
    )
    max_trajectory_age_steps: int = Field(
        default=1,
        ge=0,
        description="Oldest weight version a trained episode may come from, in "
        "steps behind the current one (async only).",
    )
    batch_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="Deadline for one step's groups to arrive, and for one validation pass.",
    )
    val_at_start: bool = Field(
        default=False, description="Validate the starting weights before the first step."
    )
    val_period: int = Field(
        default=0, ge=0, description="Validate after every N-th step; 0 = never periodically."
    )
    val_at_end: bool = Field(
        default=False, description="Validate after the last step (once, if val_period did)."
    )
    val_temperature: float = Field(
        default=0.0,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature of validation episodes: 0 = greedy (top-p unused); "
        "above 0 samples with generation.sampling.top_p.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    parity_gate: ParityGateConfig = Field(default_factory=ParityGateConfig)
