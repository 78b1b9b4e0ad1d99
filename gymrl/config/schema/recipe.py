"""The root of the tree: `RecipeConfig`, one field per top-level key, each typed in the module of
that key's name, and the typed Gym shards the validator builds once.

Checks that span groups (GPU counts, parallelism, router replay or token-capture receipt mode
with truncation) are made by `gymrl.preflight.rules` (run by `gymrl.preflight.validate`), which
reports each with its key, value and fix (the Gym shards' own, by
`nemo_gym_ext.config.build_all_gym_actor_configs`)."""

from __future__ import annotations

from pydantic import Field, PrivateAttr

from gymrl.config.schema.base import Strict
from gymrl.config.schema.checkpoint import CheckpointConfig
from gymrl.config.schema.cluster import ClusterConfig
from gymrl.config.schema.env import EnvConfig
from gymrl.config.schema.eval import EvalConfig
from gymrl.config.schema.generation import GenerationConfig
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.config.schema.logger import LoggerConfig
from gymrl.config.schema.loss import LossConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.run import RunConfig
from gymrl.config.schema.stop import StopConfig
from gymrl.config.schema.token_capture import TokenCaptureConfig
from gymrl.config.schema.trainer import TrainerConfig
from nemo_gym_ext.config import GymActorConfig


class RecipeConfig(Strict):
    run: RunConfig
    dry_run: bool = Field(
        default=False, description="Validate, print the plan and exit without starting anything."
    )
    resume: bool = Field(default=False, description="Continue from the last checkpoint.")
    policy: PolicyConfig
    generation: GenerationConfig
    trainer: TrainerConfig
    loss: LossConfig = Field(default_factory=LossConfig)
    env: EnvConfig
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    grpo: GRPOConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    stop: StopConfig = Field(default_factory=StopConfig)
    token_capture: TokenCaptureConfig = Field(default_factory=TokenCaptureConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # The typed Gym shards of `env.nemo_gym` (each shard's overrides merged over the base, the
    # recipe-only keys validated), built once by `gymrl.preflight.validate.validate_config`,
    # because the builder needs switches from elsewhere in the tree (router replay, receipt mode).
    _gym_shards: tuple[GymActorConfig, ...] | None = PrivateAttr(default=None)

    @property
    def gym_shards(self) -> tuple[GymActorConfig, ...]:
        """Every Gym shard's actor config, in `env.nemo_gym` order."""
        if self._gym_shards is None:
            raise RuntimeError(
                "RecipeConfig.gym_shards is built by gymrl.preflight.validate.validate_config; "
                "make the config with it instead of RecipeConfig.model_validate"
            )
        return self._gym_shards

    def with_gym_shards(self, shards: list[GymActorConfig]) -> RecipeConfig:
        """This config carrying `shards` (the validator's one build of them)."""
        config = self.model_copy()
        config._gym_shards = tuple(shards)
        return config
