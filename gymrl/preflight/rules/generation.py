"""Rules on `generation.*` (`gymrl.config.schema.generation`): the per-turn token limit against
the context, the trainer that refits the engine, and the SGLang engines' parallelism, GPUs and
refit check (the torch engine has none of these)."""

from __future__ import annotations

from gymrl.config.schema.generation import SGLangGenerationConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.sglang.adapters import FUSED_GROUPS, FUSED_NEEDS
from nemo_gym_ext.config_errors import ConfigIssue


def max_tokens_below_context(config: RecipeConfig) -> list[ConfigIssue]:
    max_tokens = config.generation.server.max_tokens_per_turn
    context = config.policy.max_total_sequence_length
    if max_tokens < context:
        return []
    return [
        ConfigIssue(
            "generation.server.max_tokens_per_turn",
            max_tokens,
            f"must be below policy.max_total_sequence_length={context}",
            "lower it or raise the context limit",
        )
    ]


def refit_by_the_trainer(config: RecipeConfig) -> list[ConfigIssue]:
    """Roles that cannot hand weights to each other, refused here rather than at the first
    refit. The torch trainer refits either engine (state dict to the torch engine through Ray,
    or as safetensors the SGLang servers load); the Megatron trainer exports every weight as a
    checkpoint on disk or a broadcast, which only SGLang loads, except with LoRA, where it hands
    over the adapter alone in PEFT's format, which the torch engine merges
    (`TorchGenerationEngine.update_adapter`) as it does the torch trainer's."""
    generation = config.generation.backend
    if config.trainer.backend != "megatron" or generation == "sglang":
        return []
    if config.trainer.lora.enabled:
        return []
    return [
        ConfigIssue(
            "generation.backend",
            generation,
            "the megatron trainer (trainer.backend) refits generation with a Hugging Face "
            f"checkpoint on disk, which only SGLang loads; the {generation} engine cannot",
            "select generation=sglang, or trainer=torch, or train LoRA "
            "(trainer.lora.enabled=true: its adapter refit reaches the torch engine)",
        )
    ]


def lora_refit_into_the_engine(config: RecipeConfig) -> list[ConfigIssue]:
    """A LoRA run refits the adapter alone: the torch engine merges it into its weights
    (`TorchGenerationEngine.update_adapter`), the SGLang servers load it unmerged
    (`SGLangEngine.update_adapter`), which needs kernels that run on their device and a target
    set SGLang can stack into its fused modules (`gymrl.generation.sglang.adapters`)."""
    lora, generation = config.trainer.lora, config.generation
    if not lora.enabled or not isinstance(generation, SGLangGenerationConfig):
        return []
    issues = []
    backend = generation.launch.lora_backend
    if generation.launch.device == "cpu" and backend != "torch_native":
        issues.append(
            ConfigIssue(
                "generation.launch.lora_backend",
                backend,
                "SGLang's LoRA kernels other than torch_native need a GPU, and the servers run "
                "on the CPU (generation.launch.device=cpu)",
                "set generation.launch.lora_backend=torch_native",
            )
        )
    targets = set(lora.target_modules)
    for fused, members in FUSED_GROUPS.items():
        needed = FUSED_NEEDS[fused]
        if targets & set(members) and not set(needed) <= targets:
            issues.append(
                ConfigIssue(
                    "trainer.lora.target_modules",
                    list(lora.target_modules),
                    f"SGLang fuses {', '.join(members)} into {fused} and builds an adapter on "
                    f"it from the factors of {' and '.join(needed)}; an adapter on "
                    f"{sorted(targets & set(members))} alone is one SGLang cannot serve",
                    f"add {sorted(set(needed) - targets)} to trainer.lora.target_modules, or "
                    "select generation=torch",
                )
            )
    return issues


def expert_parallel_divides_tp(config: RecipeConfig) -> list[ConfigIssue]:
    generation = config.generation
    if not isinstance(generation, SGLangGenerationConfig) or not (
        generation.tensor_parallel_size % generation.expert_parallel_size
    ):
        return []
    return [
        ConfigIssue(
            "generation.expert_parallel_size",
            generation.expert_parallel_size,
            f"must divide generation.tensor_parallel_size={generation.tensor_parallel_size} "
            "(SGLang runs expert parallelism inside the TP group)",
            "use a divisor of tensor_parallel_size",
        )
    ]


def engines_fit_the_cluster(config: RecipeConfig) -> list[ConfigIssue]:
    generation, total_gpus = config.generation, config.cluster.total_gpus
    if not isinstance(generation, SGLangGenerationConfig) or generation.num_gpus <= total_gpus:
        return []
    return [
        ConfigIssue(
            "generation.num_engines",
            generation.num_engines,
            f"{generation.num_engines} engines x TP {generation.tensor_parallel_size} = "
            f"{generation.num_gpus} GPUs, but the cluster has {total_gpus}",
            "lower generation.num_engines or raise cluster.num_nodes / cluster.gpus_per_node",
        )
    ]


def read_back_needs_a_broadcast(config: RecipeConfig) -> list[ConfigIssue]:
    generation = config.generation
    if not isinstance(generation, SGLangGenerationConfig):
        return []
    refit = generation.refit
    checks_a_broadcast = refit.verify_weights and refit.verify_method == "read_back"
    if not checks_a_broadcast or refit.transport != "disk":
        return []
    return [
        ConfigIssue(
            "generation.refit.verify_method",
            refit.verify_method,
            "read_back compares samples of the tensors a broadcast sent; a disk refit "
            "(generation.refit.transport=disk) sends none, so no refit would be checked",
            "use verify_method=weights_checker (the default), or transport=nccl",
        )
    ]
