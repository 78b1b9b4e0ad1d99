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
        issues += _megatron_lora(config)
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


# How megatron-bridge's LoRA (`megatron.bridge.peft.lora.LoRA`) names the Linear modules of a
# Llama-family decoder layer: Megatron fuses q, k and v into one linear_qkv and the gated MLP's
# gate and up into one linear_fc1, and bridge's LoRA adapts a fused module whole (one A, one B
# over the concatenated outputs; its export splits B back into the Hugging Face modules, each
# with the shared A).
MEGATRON_LORA_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
_MLP_MODULES = frozenset(("gate_proj", "up_proj", "down_proj"))


def megatron_lora_targets(hf_targets: tuple[str, ...]) -> list[str]:
    """The Megatron modules megatron-bridge's LoRA adapts for `trainer.lora.target_modules`
    (Hugging Face names), in Megatron's order: a fused module is adapted if any of its parts is
    named (:func:`_megatron_lora` refuses a partial set before this is asked)."""
    return [
        megatron
        for megatron, parts in MEGATRON_LORA_MODULES.items()
        if any(part in hf_targets for part in parts)
    ]


def _megatron_lora(config: RecipeConfig) -> list[ConfigIssue]:
    """What the Megatron trainer's LoRA cannot honour. A fused module named in part would adapt
    the parts not named as well (one adapter over the fused output), which is not the adapter
    asked for; a target outside the decoder layers' Linears has no Megatron module here; an MoE
    policy's MLP is its experts, which bridge's LoRA adapts one by one and whose adapter neither
    the torch engine (transformers stacks an MoE layer's experts into 3-D parameters, which
    PEFT's Linear adapters miss) nor this project's SGLang refit has been shown to load."""
    lora = config.trainer.lora
    targets = tuple(lora.target_modules)
    issues = []
    known = {part for parts in MEGATRON_LORA_MODULES.values() for part in parts}
    unknown = sorted(name for name in targets if name not in known)
    if unknown:
        issues.append(
            ConfigIssue(
                "trainer.lora.target_modules",
                list(targets),
                f"{unknown} have no Megatron module the Megatron trainer's LoRA adapts (it maps "
                f"{sorted(known)} onto linear_qkv, linear_proj, linear_fc1 and linear_fc2)",
                f"name modules among {sorted(known)}, or set trainer=torch",
            )
        )
    for megatron, parts in MEGATRON_LORA_MODULES.items():
        named = [part for part in parts if part in targets]
        if named and len(named) < len(parts):
            issues.append(
                ConfigIssue(
                    "trainer.lora.target_modules",
                    list(targets),
                    f"the Megatron trainer holds {', '.join(parts)} as one fused {megatron}, and "
                    f"megatron-bridge's LoRA adapts it whole: naming {named} alone would adapt "
                    f"{[part for part in parts if part not in named]} too",
                    f"name all of {list(parts)} or none of them, or set trainer=torch",
                )
            )
    mlp = sorted(name for name in targets if name in _MLP_MODULES)
    if config.policy.is_moe and mlp:
        issues.append(
            ConfigIssue(
                "trainer.lora.target_modules",
                list(targets),
                f"an MoE policy's MLP ({mlp}) is its experts, which megatron-bridge's LoRA "
                "adapts one by one; no engine here loads such an adapter yet (transformers "
                "stacks an MoE layer's experts into 3-D parameters that the torch engine's "
                "merge and PEFT's Linear adapters miss)",
                "set trainer.lora.target_modules=[q_proj,k_proj,v_proj,o_proj] (attention "
                "only) for an MoE policy",
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
