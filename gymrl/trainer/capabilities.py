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
    megatron = isinstance(config.trainer, MegatronTrainerConfig)
    if config.policy.router_replay.enabled and not megatron:
        issues.append(
            ConfigIssue(
                "policy.router_replay.enabled",
                True,
                f"the {config.trainer.backend} trainer does not replay MoE routing (only the "
                "Megatron trainer installs the engine's routes in its routers)",
                "set trainer=megatron, or policy.router_replay.enabled=false",
            )
        )
    lora = config.trainer.lora
    if lora.enabled and megatron:
        issues.append(
            ConfigIssue(
                "trainer.lora.enabled",
                True,
                "the Megatron trainer does not train LoRA adapters yet (the torch trainer does, "
                "through PEFT)",
                "set trainer=torch, or trainer.lora.enabled=false",
            )
        )
    if lora.enabled and not megatron and config.policy.is_moe:
        issues.append(
            ConfigIssue(
                "trainer.lora.enabled",
                True,
                "the torch trainer adapts Linear modules through PEFT, and transformers holds an "
                "MoE layer's experts as stacked 3-D parameters, not Linear modules: the adapter "
                "would miss the experts",
                "use a dense policy, or trainer.lora.enabled=false",
            )
        )
    if not isinstance(config.trainer, MegatronTrainerConfig):
        return issues
    issues += _router_replay_layout(config, config.trainer)
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


def _router_replay_layout(
    config: RecipeConfig, trainer: MegatronTrainerConfig
) -> list[ConfigIssue]:
    """Router replay installs each micro-batch's routes before its forward pass and keeps them
    until the next one, which is what a recomputation in the backward pass reads: right when
    each micro-batch's backward follows its forward (one pipeline stage), wrong under a
    pipeline schedule that runs other micro-batches' forwards in between."""
    if not config.policy.router_replay.enabled:
        return []
    if trainer.pipeline_model_parallel_size > 1 and trainer.activation_checkpointing:
        return [
            ConfigIssue(
                "trainer.pipeline_model_parallel_size",
                trainer.pipeline_model_parallel_size,
                "router replay with activation checkpointing recomputes a micro-batch's routing "
                "in its backward pass, after the pipeline schedule ran later micro-batches' "
                "forwards, whose routes would be replayed instead",
                "set trainer.activation_checkpointing=false, or "
                "trainer.pipeline_model_parallel_size=1",
            )
        ]
    return []
