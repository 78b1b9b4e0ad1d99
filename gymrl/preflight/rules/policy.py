"""Rules on `policy.*` (`gymrl.config.schema.policy`): its shape, its source, its context, how
it is rendered and which backends can honour its settings."""

from __future__ import annotations

import json

from gymrl.config.context_length import context_issues, local_model_config
from gymrl.config.schema.generation import SGLangGenerationConfig, TorchGenerationConfig
from gymrl.config.schema.policy import EXPERT_COUNT_KEYS, PolicyConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig, TorchTrainerConfig
from gymrl.generation.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from gymrl.generation.server.templates import bundled_chat_templates, chat_template_path
from nemo_gym_ext.config_errors import ConfigIssue


def tiny_heads_divide_hidden_size(config: RecipeConfig) -> list[ConfigIssue]:
    tiny = config.policy.tiny
    if not tiny.hidden_size % tiny.num_heads:
        return []
    return [
        ConfigIssue(
            "policy.tiny.num_heads",
            tiny.num_heads,
            f"must divide policy.tiny.hidden_size={tiny.hidden_size}",
            "pick num_heads among the divisors of hidden_size",
        )
    ]


def pretrained_needs_path(config: RecipeConfig) -> list[ConfigIssue]:
    policy = config.policy
    if policy.source != "pretrained" or policy.path:
        return []
    return [
        ConfigIssue(
            "policy.path",
            None,
            "required when policy.source=pretrained",
            "set policy.path to a checkpoint folder",
        )
    ]


def router_replay_needs_moe(config: RecipeConfig) -> list[ConfigIssue]:
    """Router replay replays the routes an MoE model's SGLang servers captured: a dense policy
    has none, and the torch engine captures none."""
    policy = config.policy
    if not policy.router_replay.enabled:
        return []
    issues = []
    if not policy.is_moe:
        issues.append(
            ConfigIssue(
                "policy.router_replay.enabled",
                True,
                "router replay needs an MoE policy",
                "set policy.router_replay.enabled=false or use an MoE policy (is_moe=true)",
            )
        )
    if config.generation.backend != "sglang":
        issues.append(
            ConfigIssue(
                "generation.backend",
                config.generation.backend,
                "router replay needs each token's experts from the generation engine, which "
                "only the SGLang servers report (--enable-return-routed-experts)",
                "set generation=sglang (generation=sglang_cpu on a CPU), or "
                "policy.router_replay.enabled=false",
            )
        )
    return issues


def context_fits(config: RecipeConfig) -> list[ConfigIssue]:
    """The native context (or YaRN's) against the episode length (`gymrl.config.context_length`);
    a pretrained policy without a path is reported by :func:`pretrained_needs_path` instead."""
    policy = config.policy
    if policy.source == "pretrained" and not policy.path:
        return []
    return context_issues(policy)


def yarn_needs_sglang_and_megatron(config: RecipeConfig) -> list[ConfigIssue]:
    policy = config.policy
    torch_role = isinstance(config.generation, TorchGenerationConfig) or isinstance(
        config.trainer, TorchTrainerConfig
    )
    if policy.yarn is None or not torch_role:
        return []
    return [
        ConfigIssue(
            "policy.yarn",
            policy.yarn.model_dump(),
            "YaRN is applied to SGLang and Megatron only; the torch engine and trainer use "
            "the checkpoint's own RoPE",
            "use generation=sglang and trainer=megatron, or remove policy.yarn and stay "
            "within the native context",
        )
    ]


def chat_template_exists(config: RecipeConfig) -> list[ConfigIssue]:
    name = config.policy.chat_template
    if name is None:
        return []
    try:
        chat_template_path(name)
    except FileNotFoundError as error:
        return [
            ConfigIssue(
                "policy.chat_template",
                name,
                str(error),
                f"use one of {bundled_chat_templates()}, a .jinja file's absolute path, or "
                "null for the tokenizer's own template",
            )
        ]
    return []


def parsers_known(config: RecipeConfig) -> list[ConfigIssue]:
    policy = config.policy
    return [
        ConfigIssue(
            f"policy.{key}",
            name,
            "this recipe has no such parser",
            f"set policy.{key} to one of {sorted(known)}"
            + (" or null" if key == "reasoning_parser" else ""),
        )
        for key, name, known in (
            ("tool_call_parser", policy.tool_call_parser, TOOL_CALL_PARSERS),
            ("reasoning_parser", policy.reasoning_parser, REASONING_PARSERS),
        )
        if name is not None and name not in known
    ]


def compute_dtype_needs_a_torch_role(config: RecipeConfig) -> list[ConfigIssue]:
    compute_dtype = config.policy.compute_dtype
    if (
        compute_dtype == "auto"
        or config.trainer.backend == "torch"
        or config.generation.backend == "torch"
    ):
        return []
    return [
        ConfigIssue(
            "policy.compute_dtype",
            compute_dtype,
            "only the torch trainer and torch engine run under autocast; Megatron and SGLang "
            "take their precision from policy.dtype, so this setting would do nothing",
            "leave policy.compute_dtype at auto and set policy.dtype",
        )
    ]


def sglang_needs_a_checkpoint(config: RecipeConfig) -> list[ConfigIssue]:
    """SGLang serves the policy's checkpoint folder, which a tiny random model does not have."""
    if config.generation.backend != "sglang" or config.policy.source != "tiny_random":
        return []
    return [
        ConfigIssue(
            "policy.source",
            config.policy.source,
            "SGLang servers load the policy from its checkpoint folder, and a tiny random "
            "model has none: they would serve SmolLM2 while the trainer trains the tiny model",
            "select generation=torch for a tiny model, or a policy with a checkpoint",
        )
    ]


def expert_parallelism_divides_experts(config: RecipeConfig) -> list[ConfigIssue]:
    """Each expert-parallel rank holds an equal share of every layer's experts, in Megatron and in
    SGLang alike: an expert count the degree does not divide fails only once the model loads on
    the cluster. Checked where the count is known here (the tiny MoE, a local folder)."""
    experts = _expert_count(config.policy)
    if experts is None:
        return []
    degrees = []
    if isinstance(config.trainer, MegatronTrainerConfig):
        degrees.append(
            ("trainer.expert_model_parallel_size", config.trainer.expert_model_parallel_size)
        )
    if isinstance(config.generation, SGLangGenerationConfig):
        degrees.append(("generation.expert_parallel_size", config.generation.expert_parallel_size))
    return [
        ConfigIssue(
            key,
            degree,
            f"the policy has {experts} experts per layer, which {degree} expert-parallel ranks "
            "cannot share equally",
            f"set {key} to a divisor of {experts}",
        )
        for key, degree in degrees
        if experts % degree
    ]


def _expert_count(policy: PolicyConfig) -> int | None:
    """Experts per layer of an MoE policy whose config is at hand; None otherwise."""
    if not policy.is_moe:
        return None
    if policy.source == "tiny_random_moe":
        return policy.tiny_moe.num_experts
    config_file = local_model_config(policy)
    if config_file is None or not config_file.is_file():
        return None
    model_config = json.loads(config_file.read_text())
    counts = [model_config[key] for key in EXPERT_COUNT_KEYS if key in model_config]
    return counts[0] if counts and isinstance(counts[0], int) else None
