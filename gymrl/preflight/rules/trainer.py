"""Rules on `trainer.*` (`gymrl.config.schema.trainer`): what the configured trainer cannot do
(`gymrl.trainer.capabilities`), the Megatron trainer's parallelism against its GPUs, and a LoRA
adapter's modules and rank against the model's (`gymrl.config.model_linears`)."""

from __future__ import annotations

from gymrl.cluster.placement import generation_gpus, trainer_gpus
from gymrl.config.model_linears import decoder_linears
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig
from gymrl.trainer.capabilities import unsupported_by_trainer
from nemo_gym_ext.config_errors import ConfigIssue


def supported_by_the_trainer(config: RecipeConfig) -> list[ConfigIssue]:
    """Defined beside the trainers, which check it again before they touch a GPU."""
    return unsupported_by_trainer(config)


def sequence_parallel_needs_tp(config: RecipeConfig) -> list[ConfigIssue]:
    trainer = config.trainer
    if not isinstance(trainer, MegatronTrainerConfig):
        return []
    if not trainer.sequence_parallel or trainer.tensor_model_parallel_size != 1:
        return []
    return [
        ConfigIssue(
            "trainer.sequence_parallel",
            True,
            "needs tensor_model_parallel_size > 1",
            "set trainer.sequence_parallel=false or raise the TP degree",
        )
    ]


def megatron_has_gpus(config: RecipeConfig) -> list[ConfigIssue]:
    """The Megatron trainer runs on the GPUs generation leaves. Without any, the rules below on
    its parallel sizes have nothing to divide and say nothing: this is the one issue."""
    if not isinstance(config.trainer, MegatronTrainerConfig):
        return []
    gpus = trainer_gpus(config)
    if gpus > 0:
        return []
    cluster = config.cluster
    return [
        ConfigIssue(
            "cluster.gpus_per_node",
            cluster.gpus_per_node,
            f"the Megatron trainer needs GPUs, and {cluster.total_gpus} in all minus "
            f"{generation_gpus(config)} for generation leaves {gpus}",
            "raise cluster.num_nodes / cluster.gpus_per_node or lower generation.num_engines",
        )
    ]


def model_parallel_divides_gpus(config: RecipeConfig) -> list[ConfigIssue]:
    megatron = _megatron_with_gpus(config)
    if megatron is None:
        return []
    trainer, gpus = megatron
    if not gpus % trainer.model_parallel_size:
        return []
    return [
        ConfigIssue(
            "trainer.tensor_model_parallel_size",
            trainer.tensor_model_parallel_size,
            f"TP x PP x CP = {trainer.model_parallel_size} must divide the {gpus} trainer GPUs",
            "choose parallel sizes whose product divides the trainer's GPUs",
        )
    ]


def expert_group_divides_gpus(config: RecipeConfig) -> list[ConfigIssue]:
    megatron = _megatron_with_gpus(config)
    if megatron is None:
        return []
    trainer, gpus = megatron
    expert_group = (
        trainer.expert_model_parallel_size
        * trainer.expert_tensor_parallel_size
        * trainer.pipeline_model_parallel_size
    )
    if not gpus % expert_group:
        return []
    return [
        ConfigIssue(
            "trainer.expert_model_parallel_size",
            trainer.expert_model_parallel_size,
            f"EP x ETP x PP = {expert_group} must divide the {gpus} trainer GPUs",
            "choose an expert-parallel size that divides the trainer's GPUs per stage",
        )
    ]


def expert_parallel_needs_moe(config: RecipeConfig) -> list[ConfigIssue]:
    megatron = _megatron_with_gpus(config)
    if megatron is None or megatron[0].expert_model_parallel_size <= 1 or config.policy.is_moe:
        return []
    return [
        ConfigIssue(
            "trainer.expert_model_parallel_size",
            megatron[0].expert_model_parallel_size,
            "expert parallelism needs an MoE policy",
            "set trainer.expert_model_parallel_size=1 or policy.is_moe=true",
        )
    ]


def lora_targets_exist(config: RecipeConfig) -> list[ConfigIssue]:
    """A target module the model does not have: PEFT would refuse it only once the trainer has
    loaded the model, after every other role started."""
    lora = config.trainer.lora
    known = decoder_linears(config.policy) if lora.enabled else None
    if known is None:
        return []
    linears, source = known
    missing = [name for name in lora.target_modules if name not in linears]
    if not missing:
        return []
    return [
        ConfigIssue(
            "trainer.lora.target_modules",
            list(lora.target_modules),
            f"{missing} are not Linear modules of the model's decoder layers ({source})",
            f"name modules among {sorted(linears)}",
        )
    ]


def lora_rank_fits_the_targets(config: RecipeConfig) -> list[ConfigIssue]:
    """The torch engine merges the adapter into the weights it adapts, so the most it can hold is
    a full-rank update: B @ A of a rank above a weight's smaller side has no more rank than that
    side, for more parameters (and optimizer state) than the weight itself."""
    lora = config.trainer.lora
    known = decoder_linears(config.policy) if lora.enabled else None
    if known is None:
        return []
    linears, source = known
    sides = {name: min(linears[name]) for name in lora.target_modules if name in linears}
    if not sides or lora.rank <= min(sides.values()):
        return []
    smallest = min(sides, key=sides.__getitem__)
    return [
        ConfigIssue(
            "trainer.lora.rank",
            lora.rank,
            f"exceeds the smaller side of {smallest} ({sides[smallest]}: in x out = "
            f"{linears[smallest][0]} x {linears[smallest][1]}, {source}), the highest rank its "
            "merged update can have",
            f"set trainer.lora.rank to at most {sides[smallest]}, or train every weight "
            "(trainer.lora.enabled=false)",
        )
    ]


def _megatron_with_gpus(config: RecipeConfig) -> tuple[MegatronTrainerConfig, int] | None:
    """The Megatron trainer's config and its GPUs, when it is the trainer and has some (else
    :func:`megatron_has_gpus` reports the one issue)."""
    trainer = config.trainer
    if not isinstance(trainer, MegatronTrainerConfig):
        return None
    gpus = trainer_gpus(config)
    return (trainer, gpus) if gpus > 0 else None
