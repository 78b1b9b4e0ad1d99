"""Config -> Megatron arguments: pure functions, checked on the CPU (and bound to the real
signatures of megatron-core in the GPU tests)."""

from __future__ import annotations

from typing import Any

import torch

from gymrl.config.context_length import megatron_rope_overrides
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig
from gymrl.trainer.capabilities import megatron_lora_targets, unsupported_by_trainer


def parallel_state_kwargs(trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.parallel_state.initialize_model_parallel`."""
    return {
        "tensor_model_parallel_size": trainer.tensor_model_parallel_size,
        "pipeline_model_parallel_size": trainer.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": trainer.context_parallel_size,
        "expert_model_parallel_size": trainer.expert_model_parallel_size,
        "expert_tensor_parallel_size": trainer.expert_tensor_parallel_size,
    }


def provider_overrides(config: RecipeConfig) -> dict[str, Any]:
    """Attributes set on the Megatron-Bridge model provider (a `TransformerConfig`).

    Parallelism must match `parallel_state`; `calculate_per_token_loss=False` because the GRPO
    loss does its own normalisation (:func:`megatron_loss_scale`); full uniform recomputation of
    every layer when activation checkpointing is on (long agentic episodes dominate memory);
    `policy.yarn`'s RoPE scaling, the one SGLang generates with.

    An MoE policy (`policy.is_moe`) trains without the load-balancing loss Bridge's providers
    carry over from pre-training (Qwen3-MoE: `aux_loss`, 1e-3): the GRPO loss is the only
    objective, every gradient is one the loss metrics and the parity gate account for, and the
    routers are not pushed away from the experts the generation engine picked (verl's Qwen3-MoE
    bridge also trains RL with `none`). Without Transformer Engine (`transformer_impl: local`)
    the experts are Megatron's own sequential MLPs and the tokens are permuted in plain torch:
    no grouped GEMM, no fused permutation (Megatron refuses the fusion without TE).
    """
    trainer = megatron_config(config)
    bf16 = config.policy.dtype == "bfloat16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    overrides = (
        parallel_state_kwargs(trainer)
        | {
            "sequence_parallel": trainer.sequence_parallel,
            "bf16": bf16,
            "fp16": False,
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            "seq_length": config.policy.max_total_sequence_length,
            "calculate_per_token_loss": False,
            "variable_seq_lengths": False,
            "transformer_impl": trainer.transformer_impl,
        }
        | megatron_rope_overrides(config.policy)
    )
    if trainer.transformer_impl == "local":
        # Fused kernels that only Transformer Engine (or apex) provides.
        overrides |= {
            "apply_rope_fusion": False,
            "gradient_accumulation_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
        }
    if config.policy.is_moe:
        overrides["moe_router_load_balancing_type"] = "none"
        if config.policy.router_replay.enabled:
            # The fused top-k skips the router's replay (gymrl.trainer.megatron.router_replay).
            overrides["moe_router_fusion"] = False
        if trainer.transformer_impl == "local":
            overrides |= {"moe_grouped_gemm": False, "moe_permute_fusion": False}
    if trainer.activation_checkpointing:
        overrides |= {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return overrides


def ddp_config_kwargs(trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.distributed.DistributedDataParallelConfig`.

    `average_in_collective=False` keeps Megatron's "scale by 1/DP, sum over DP x CP" reduction,
    which :func:`megatron_loss_scale` undoes; gradients are reduced in fp32.
    """
    del trainer  # the same for every layout; the parameter keeps the call sites uniform
    return {
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": False,
        "overlap_param_gather": False,
        "use_distributed_optimizer": True,
        "average_in_collective": False,
        "check_for_nan_in_grad": True,
    }


def optimizer_config_kwargs(config: RecipeConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.optimizer.OptimizerConfig` (Adam = AdamW in Megatron)."""
    optimizer = megatron_config(config).optimizer
    bf16 = config.policy.dtype == "bfloat16"
    return {
        "optimizer": "adam",
        "lr": optimizer.lr,
        "min_lr": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "adam_beta1": optimizer.betas[0],
        "adam_beta2": optimizer.betas[1],
        "adam_eps": optimizer.eps,
        "clip_grad": optimizer.max_grad_norm,
        "bf16": bf16,
        "fp16": False,
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
        "use_distributed_optimizer": True,
    }


def lora_kwargs(config: RecipeConfig) -> dict[str, Any]:
    """Arguments of megatron-bridge's `megatron.bridge.peft.lora.LoRA` for `trainer.lora`.

    The Hugging Face target names become Megatron's fused modules
    (`gymrl.trainer.capabilities.MEGATRON_LORA_MODULES`); the update is scaled by alpha / rank
    and dropout is applied to the adapter's input, as PEFT does, and A starts random and B at
    zero, so the adapted model starts as the base one. The adapter's parameters take the
    model's dtype (`lora_dtype` None), as PEFT's do.
    """
    lora = megatron_config(config).lora
    return {
        "target_modules": megatron_lora_targets(lora.target_modules),
        "dim": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "dropout_position": "pre",
        "lora_A_init_method": "xavier",
        "lora_B_init_method": "zero",
    }


def scheduler_kwargs(config: RecipeConfig) -> dict[str, Any]:
    """Arguments of `megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`: a
    constant learning rate and weight decay (it also applies the no-decay groups' `wd_mult`)."""
    optimizer = megatron_config(config).optimizer
    steps = max(config.grpo.num_steps, 1)
    return {
        "init_lr": optimizer.lr,
        "max_lr": optimizer.lr,
        "min_lr": optimizer.lr,
        "lr_warmup_steps": 0,
        "lr_decay_steps": steps,
        "lr_decay_style": "constant",
        "start_wd": optimizer.weight_decay,
        "end_wd": optimizer.weight_decay,
        "wd_incr_steps": steps,
        "wd_incr_style": "constant",
    }


def unsupported_settings(config: RecipeConfig) -> list[str]:
    """What the Megatron trainer cannot do for `config`, each with its fix (empty: fine). The
    rules live with the config validator, which reports them at composition time."""
    return [issue.render() for issue in unsupported_by_trainer(config)]


def sequence_multiple(trainer: MegatronTrainerConfig) -> int:
    """Sequence lengths must be a multiple of this: `2 x CP` chunks under context parallelism,
    times `TP` under sequence parallelism (each TP rank holds an equal slice)."""
    multiple = 2 * trainer.context_parallel_size if trainer.context_parallel_size > 1 else 1
    if trainer.sequence_parallel:
        multiple *= trainer.tensor_model_parallel_size
    return multiple


def data_parallel_size(world_size: int, trainer: MegatronTrainerConfig) -> int:
    if world_size % trainer.model_parallel_size:
        raise ValueError(
            f"{world_size} trainer GPUs are not a multiple of TP x PP x CP = "
            f"{trainer.model_parallel_size}; change the parallel sizes or the GPU count"
        )
    return world_size // trainer.model_parallel_size


def megatron_loss_scale(
    num_microbatches: int, data_parallel_size: int, context_parallel_size: int
) -> float:
    """Factor that turns a micro-batch's share of the full-batch loss into what Megatron expects.

    Megatron divides each micro-batch loss by `num_microbatches`, scales gradients by `1/DP` and
    sums them over DP x CP ranks; every CP rank computes the whole-sequence loss.
    """
    return num_microbatches * data_parallel_size / context_parallel_size


def megatron_config(config: RecipeConfig) -> MegatronTrainerConfig:
    if not isinstance(config.trainer, MegatronTrainerConfig):
        raise ValueError(f"trainer.backend is {config.trainer.backend!r}, not 'megatron'")
    return config.trainer
