"""What each trainer backend cannot do, as config issues with their fixes.

Defined next to the trainers, whose limits these are; reported by the config validator at
composition time (`gymrl.preflight.validate`), and checked again by the Megatron trainer before it
touches a GPU, for configs built in code. Torch-free, so dry runs can import it.
"""

from __future__ import annotations

from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig
from nemo_gym_ext.config_errors import ConfigIssue


def unsupported_by_trainer(config: RecipeConfig) -> list[ConfigIssue]:
    """Settings the configured trainer cannot honour. Reported at composition time, and checked
    again by the trainers themselves before they touch a GPU."""
    issues = []
    if config.policy.router_replay.enabled:
        issues.append(
            ConfigIssue(
                "policy.router_replay.enabled",
                True,
                f"the {config.trainer.backend} trainer does not replay MoE routing (trajectories "
                "carry no routing decisions yet)",
                "set policy.router_replay.enabled=false",
            )
        )
    if not isinstance(config.trainer, MegatronTrainerConfig):
        return issues
    if config.loss.kl_coef > 0:
        issues.append(
            ConfigIssue(
                "loss.kl_coef",
                config.loss.kl_coef,
                "the Megatron trainer holds no reference model (a second copy of the weights "
                "on every rank)",
                "set loss.kl_coef=0",
            )
        )
    trainer = config.trainer
    if trainer.transformer_impl == "local" and trainer.context_parallel_size > 1:
        issues.append(
            ConfigIssue(
                "trainer.transformer_impl",
                trainer.transformer_impl,
                f"context parallelism (trainer.context_parallel_size="
                f"{trainer.context_parallel_size}) needs Transformer Engine's attention",
                "set trainer.transformer_impl=transformer_engine, or "
                "trainer.context_parallel_size=1",
            )
        )
    if config.policy.source == "tiny_random":
        issues.append(
            ConfigIssue(
                "policy.source",
                config.policy.source,
                "the Megatron trainer builds the model from a Hugging Face checkpoint, and a tiny "
                "random model has none (the embedded SmolLM2 and a pretrained folder have one)",
                "set policy.source=pretrained and policy.path, or policy.source=smollm2_wheel",
            )
        )
    return issues
