"""Validate a composed config once, reporting every problem with its key, value and fix.

Two passes, both always run so that one error message lists everything wrong with a config:

1. structure and types: pydantic (`extra="forbid"`) over the whole tree;
2. cross-field rules that no single field can check: the model's native context (or YaRN)
   against the episode length (`gymrl.config.context_length`), backend pairs that cannot refit, GPU
   budget and parallelism, async GRPO's need for importance sampling, the roles' environments, and,
   per Gym shard, the recipe-only keys and their incompatibilities and the agents (built by
   `nemo_gym_ext.config.build_gym_actor_config`). The Gym rules read the raw tree, so they
   report even when an unrelated field fails pass 1; the shards they build are the ones the run
   uses (`RecipeConfig.gym_shards`): merged and validated once. Last, a shard without truncation
   whose clients send text only is refused when the template probe
   (`gymrl.preflight.template_probe`) shows the template breaks such an episode: the run would
   stop at its first one.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import PurePosixPath
from typing import Any

from pydantic import BaseModel, ValidationError

from gymrl.cluster.placement import generation_gpus, trainer_gpus
from gymrl.config.context_length import context_issues
from gymrl.config.schema.env import EnvConfig
from gymrl.config.schema.generation import TorchGenerationConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.config.schema.trainer import MegatronTrainerConfig, TorchTrainerConfig
from gymrl.generation.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from gymrl.generation.server.templates import bundled_chat_templates, chat_template_path
from gymrl.preflight.token_id_clients import HONOR_KEY, shard_clients
from gymrl.trainer.capabilities import unsupported_by_trainer
from nemo_gym_ext.config import (
    TRUNCATION_KEY,
    EnvSource,
    GymActorConfig,
    build_all_gym_actor_configs,
)
from nemo_gym_ext.config_errors import ConfigError, ConfigIssue


def validate_config(raw: Mapping[str, Any]) -> RecipeConfig:
    """Return the typed config or raise :class:`ConfigError` listing every issue."""
    issues: list[ConfigIssue] = []
    config: RecipeConfig | None = None
    try:
        config = RecipeConfig.model_validate(raw)
    except ValidationError as error:
        issues.extend(_issue_from_pydantic(detail) for detail in error.errors())
    shards, gym_issues = _gym_shards(raw)
    issues.extend(gym_issues)
    if config is not None:
        issues.extend(_cross_field_issues(config))
        issues.extend(_text_only_issues(config, shards))
        issues.extend(_stop_on_divergence_issues(config, shards))
        issues.extend(_split_episode_weight_issues(config, shards))
    if issues:
        raise ConfigError(issues)
    assert config is not None
    return config.with_gym_shards(shards)


# ------------------------------------------------------------------------------------ pass 1
def _issue_from_pydantic(detail: Mapping[str, Any]) -> ConfigIssue:
    loc = tuple(detail["loc"])
    key = ".".join(str(part) for part in _strip_union_tags(loc))
    kind = detail["type"]
    value = detail.get("input")
    if kind == "extra_forbidden":
        known = list(_model_at(loc[:-1]).model_fields)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it; known keys: {sorted(known)}"
        return ConfigIssue(key, value, "unknown key", fix)
    if kind == "union_tag_invalid":
        expected = detail["ctx"]["expected_tags"]
        return ConfigIssue(
            f"{key}.backend",
            value["backend"] if isinstance(value, Mapping) else value,
            "unknown backend",
            f"use one of {expected} (select a group: {loc[0]}=<backend>)",
        )
    description = _description_at(loc)
    if kind == "missing":
        return ConfigIssue(key, None, "required key is missing", f"set {key}: {description}")
    return ConfigIssue(key, value, detail["msg"], f"give {key} a valid value: {description}")


def _strip_union_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """pydantic puts the discriminator value in the location (`generation.sglang.x`); users wrote
    `generation.x`."""
    if len(loc) > 1 and loc[0] in ("generation", "trainer") and loc[1] in _backend_tags(loc[0]):
        return (loc[0], *loc[2:])
    return loc


def _backend_tags(field: str) -> set[str]:
    return {model.model_fields["backend"].default for model in _models_of(RecipeConfig, field)}


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model class that validated the object at `loc` (tags in `loc` pick union members)."""
    model: type[BaseModel] = RecipeConfig
    parts = list(loc)
    while parts:
        candidates = _models_of(model, str(parts.pop(0)))
        if len(candidates) > 1 and parts:
            tag = parts.pop(0)
            candidates = [m for m in candidates if m.model_fields["backend"].default == tag]
        if len(candidates) != 1:
            break
        model = candidates[0]
    return model


def _description_at(loc: tuple[Any, ...]) -> str:
    """The field's description, else where its class describes its fields (the schema module of
    the key's top-level group)."""
    model = _model_at(loc[:-1])
    field = model.model_fields.get(str(loc[-1]))
    if field is None or not field.description:
        path = model.__module__.replace(".", "/")
        return f"see the field descriptions of {model.__name__} in {path}.py"
    return field.description


def _models_of(model: type[BaseModel], name: str) -> list[type[BaseModel]]:
    if name not in model.model_fields:
        return []
    annotation = model.model_fields[name].annotation
    return [arg for arg in _flatten_union(annotation) if _is_model(arg)]


def _flatten_union(annotation: Any) -> Iterator[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            yield from _flatten_union(arg)
    elif origin is typing.Annotated:
        yield from _flatten_union(typing.get_args(annotation)[0])
    else:
        yield annotation


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


# ------------------------------------------------------------------------------------ pass 2
def _gym_shards(raw: Mapping[str, Any]) -> tuple[list[GymActorConfig], list[ConfigIssue]]:
    """Every shard's actor config built from the raw tree, or the issues that stop it."""
    env = raw.get("env")
    if not isinstance(env, Mapping) or not isinstance(env.get("nemo_gym"), Mapping):
        return [], []  # pass 1 reports the missing or mistyped env.nemo_gym
    nemo_gym = env["nemo_gym"]
    source = env.get("source", EnvConfig.model_fields["source"].default)
    if source not in typing.get_args(EnvSource):
        return [], []  # pass 1 reports the unknown source
    try:
        shards = build_all_gym_actor_configs(
            nemo_gym,
            source=source,
            router_replay_enabled=_raw_switch(raw, "policy", "router_replay", "enabled"),
            token_capture_enabled=_raw_switch(raw, "token_capture", "enabled"),
        )
    except ConfigError as error:
        return [], list(error.issues)
    return shards, []


def _raw_switch(raw: Mapping[str, Any], *path: str) -> bool:
    """Whether the boolean at `path` of the raw tree is true (pass 1 reports a mistyped one)."""
    node: Any = raw
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node is True


def _cross_field_issues(config: RecipeConfig) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    policy, cluster = config.policy, config.cluster
    if config.policy.tiny.hidden_size % config.policy.tiny.num_heads:
        issues.append(
            ConfigIssue(
                "policy.tiny.num_heads",
                policy.tiny.num_heads,
                f"must divide policy.tiny.hidden_size={policy.tiny.hidden_size}",
                "pick num_heads among the divisors of hidden_size",
            )
        )
    if policy.source == "pretrained" and not policy.path:
        issues.append(
            ConfigIssue(
                "policy.path",
                None,
                "required when policy.source=pretrained",
                "set policy.path to a checkpoint folder",
            )
        )
    if policy.router_replay.enabled and not policy.is_moe:
        issues.append(
            ConfigIssue(
                "policy.router_replay.enabled",
                True,
                "router replay needs an MoE policy",
                "set policy.router_replay.enabled=false or use an MoE policy (is_moe=true)",
            )
        )
    if config.token_capture.enabled:
        issues.append(
            ConfigIssue(
                "token_capture.enabled",
                True,
                "receipt mode is not implemented: this recipe reads token ids from each Gym "
                "result's output items, not from a capture store",
                "set token_capture.enabled=false (Gym's own capture, "
                "env.nemo_gym.token_id_capture, rebuilds the output items instead)",
            )
        )
    issues.extend(_overlong_penalty_issues(config))
    issues.extend(_episode_error_issues(config))
    if config.grpo.async_enabled and config.loss.off_policy_correction.mode == "none":
        issues.append(
            ConfigIssue(
                "loss.off_policy_correction.mode",
                "none",
                "async GRPO trains on episodes sampled by older weights, which needs an "
                "off-policy correction",
                "set loss.off_policy_correction.mode=token_truncate (or another mode) or "
                "grpo.async_enabled=false",
            )
        )
    if policy.source != "pretrained" or policy.path:
        issues.extend(context_issues(policy))
    if policy.yarn is not None and (
        isinstance(config.generation, TorchGenerationConfig)
        or isinstance(config.trainer, TorchTrainerConfig)
    ):
        issues.append(
            ConfigIssue(
                "policy.yarn",
                policy.yarn.model_dump(),
                "YaRN is applied to SGLang and Megatron only; the torch engine and trainer use "
                "the checkpoint's own RoPE",
                "use generation=sglang and trainer=megatron, or remove policy.yarn and stay "
                "within the native context",
            )
        )
    max_tokens = config.generation.server.max_tokens_per_turn
    if max_tokens >= policy.max_total_sequence_length:
        issues.append(
            ConfigIssue(
                "generation.server.max_tokens_per_turn",
                max_tokens,
                f"must be below policy.max_total_sequence_length="
                f"{policy.max_total_sequence_length}",
                "lower it or raise the context limit",
            )
        )
    issues.extend(_rendering_issues(policy))
    issues.extend(_backend_pair_issues(config))
    issues.extend(_generation_issues(config.generation, cluster.total_gpus))
    issues.extend(_trainer_issues(config))
    issues.extend(_role_environment_issues(config))
    issues.extend(_eval_issues(config))
    return issues


def _eval_issues(config: RecipeConfig) -> list[ConfigIssue]:
    """pass@k needs k samples of every row; greedy samples of one row are all the same."""
    evaluation, issues = config.eval, []
    too_large = sorted({k for k in evaluation.pass_at_k if k > evaluation.num_samples})
    if too_large:
        issues.append(
            ConfigIssue(
                "eval.num_samples",
                evaluation.num_samples,
                f"pass@k needs at least k episodes per row; eval.pass_at_k asks for k={too_large}",
                f"raise eval.num_samples to {too_large[-1]} or drop those k from eval.pass_at_k",
            )
        )
    not_positive = [k for k in evaluation.pass_at_k if k < 1]
    if not_positive:
        issues.append(
            ConfigIssue(
                "eval.pass_at_k",
                evaluation.pass_at_k,
                f"k must be 1 or more, not {not_positive}",
                "list positive k, e.g. eval.pass_at_k=[1,4]",
            )
        )
    temperature = (
        config.generation.sampling.temperature
        if evaluation.temperature is None
        else evaluation.temperature
    )
    if temperature == 0 and evaluation.num_samples > 1:
        issues.append(
            ConfigIssue(
                "eval.temperature",
                0,
                f"greedy decoding makes all eval.num_samples={evaluation.num_samples} episodes "
                "of a row the same",
                "sample (eval.temperature above 0), or set eval.num_samples=1 eval.pass_at_k=[1]",
            )
        )
    return issues


def _rendering_issues(policy: PolicyConfig) -> list[ConfigIssue]:
    """The chat template and the parsers a policy names must exist in this recipe."""
    issues = []
    if policy.chat_template is not None:
        try:
            chat_template_path(policy.chat_template)
        except FileNotFoundError as error:
            issues.append(
                ConfigIssue(
                    "policy.chat_template",
                    policy.chat_template,
                    str(error),
                    f"use one of {bundled_chat_templates()}, a .jinja file's absolute path, or "
                    "null for the tokenizer's own template",
                )
            )
    for key, name, known in (
        ("tool_call_parser", policy.tool_call_parser, TOOL_CALL_PARSERS),
        ("reasoning_parser", policy.reasoning_parser, REASONING_PARSERS),
    ):
        if name is not None and name not in known:
            issues.append(
                ConfigIssue(
                    f"policy.{key}",
                    name,
                    "this recipe has no such parser",
                    f"set policy.{key} to one of {sorted(known)}"
                    + (" or null" if key == "reasoning_parser" else ""),
                )
            )
    return issues


def _backend_pair_issues(config: RecipeConfig) -> list[ConfigIssue]:
    """Roles that cannot hand weights to each other: refused here rather than at the first refit.

    The torch trainer refits either engine (state dict to the torch engine through Ray, or as
    safetensors the SGLang servers load); the Megatron trainer only exports a checkpoint to disk,
    which only SGLang loads. SGLang serves the checkpoint folder of the policy, which a tiny random
    model does not have."""
    issues = []
    generation = config.generation.backend
    if config.trainer.backend == "megatron" and generation != "sglang":
        issues.append(
            ConfigIssue(
                "generation.backend",
                generation,
                "the megatron trainer (trainer.backend) refits generation with a Hugging Face "
                f"checkpoint on disk, which only SGLang loads; the {generation} engine cannot",
                "select generation=sglang, or trainer=torch",
            )
        )
    compute_dtype = config.policy.compute_dtype
    if compute_dtype != "auto" and config.trainer.backend != "torch" and generation != "torch":
        issues.append(
            ConfigIssue(
                "policy.compute_dtype",
                compute_dtype,
                "only the torch trainer and torch engine run under autocast; Megatron and SGLang "
                "take their precision from policy.dtype, so this setting would do nothing",
                "leave policy.compute_dtype at auto and set policy.dtype",
            )
        )
    if generation == "sglang" and config.policy.source == "tiny_random":
        issues.append(
            ConfigIssue(
                "policy.source",
                config.policy.source,
                "SGLang servers load the policy from its checkpoint folder, and a tiny random "
                "model has none: they would serve SmolLM2 while the trainer trains the tiny model",
                "select generation=torch for a tiny model, or a policy with a checkpoint",
            )
        )
    return issues


def _generation_issues(generation: Any, total_gpus: int) -> list[ConfigIssue]:
    if isinstance(generation, TorchGenerationConfig):
        return []
    issues = []
    if generation.tensor_parallel_size % generation.expert_parallel_size:
        issues.append(
            ConfigIssue(
                "generation.expert_parallel_size",
                generation.expert_parallel_size,
                f"must divide generation.tensor_parallel_size={generation.tensor_parallel_size} "
                "(SGLang runs expert parallelism inside the TP group)",
                "use a divisor of tensor_parallel_size",
            )
        )
    if generation.num_gpus > total_gpus:
        issues.append(
            ConfigIssue(
                "generation.num_engines",
                generation.num_engines,
                f"{generation.num_engines} engines x TP {generation.tensor_parallel_size} = "
                f"{generation.num_gpus} GPUs, but the cluster has {total_gpus}",
                "lower generation.num_engines or raise cluster.num_nodes / cluster.gpus_per_node",
            )
        )
    refit = generation.refit
    if refit.verify_weights and refit.verify_method == "read_back" and refit.transport == "disk":
        issues.append(
            ConfigIssue(
                "generation.refit.verify_method",
                refit.verify_method,
                "read_back compares samples of the tensors a broadcast sent; a disk refit "
                "(generation.refit.transport=disk) sends none, so no refit would be checked",
                "use verify_method=weights_checker (the default), or transport=nccl",
            )
        )
    return issues


def _trainer_issues(config: RecipeConfig) -> list[ConfigIssue]:
    trainer, cluster = config.trainer, config.cluster
    issues = unsupported_by_trainer(config)
    if isinstance(trainer, TorchTrainerConfig):
        return issues
    assert isinstance(trainer, MegatronTrainerConfig)
    if trainer.sequence_parallel and trainer.tensor_model_parallel_size == 1:
        issues.append(
            ConfigIssue(
                "trainer.sequence_parallel",
                True,
                "needs tensor_model_parallel_size > 1",
                "set trainer.sequence_parallel=false or raise the TP degree",
            )
        )
    gpus = trainer_gpus(config)
    if gpus <= 0:
        issues.append(
            ConfigIssue(
                "cluster.gpus_per_node",
                cluster.gpus_per_node,
                f"the Megatron trainer needs GPUs, and {cluster.total_gpus} in all minus "
                f"{generation_gpus(config)} for generation leaves {gpus}",
                "raise cluster.num_nodes / cluster.gpus_per_node or lower generation.num_engines",
            )
        )
        return issues
    if gpus % trainer.model_parallel_size:
        issues.append(
            ConfigIssue(
                "trainer.tensor_model_parallel_size",
                trainer.tensor_model_parallel_size,
                f"TP x PP x CP = {trainer.model_parallel_size} must divide the {gpus} trainer GPUs",
                "choose parallel sizes whose product divides the trainer's GPUs",
            )
        )
    expert_group = (
        trainer.expert_model_parallel_size
        * trainer.expert_tensor_parallel_size
        * trainer.pipeline_model_parallel_size
    )
    if gpus % expert_group:
        issues.append(
            ConfigIssue(
                "trainer.expert_model_parallel_size",
                trainer.expert_model_parallel_size,
                f"EP x ETP x PP = {expert_group} must divide the {gpus} trainer GPUs",
                "choose an expert-parallel size that divides the trainer's GPUs per stage",
            )
        )
    if trainer.expert_model_parallel_size > 1 and not config.policy.is_moe:
        issues.append(
            ConfigIssue(
                "trainer.expert_model_parallel_size",
                trainer.expert_model_parallel_size,
                "expert parallelism needs an MoE policy",
                "set trainer.expert_model_parallel_size=1 or policy.is_moe=true",
            )
        )
    return issues


def _role_environment_issues(config: RecipeConfig) -> list[ConfigIssue]:
    """`cluster.roles`: what Ray's `runtime_env` can run (`gymrl.cluster.placement.runtime_env`).

    An interpreter is found by its absolute path on every node (a relative one would resolve
    against each worker's directory); Ray runs an image alone, so a role has an interpreter or
    an image. A role's environment only makes sense for a role with actors of its own: a torch
    engine runs inside the policy server. The SGLang servers are started by the policy server,
    and Ray hands a child actor every `runtime_env` field of its parent that it does not set
    itself: they must set the same field, or they would run in the policy server's environment
    (or in a mix of an interpreter and an image)."""
    issues = []
    roles = config.cluster.roles
    for role in type(roles).model_fields:
        environment = getattr(roles, role)
        key = f"cluster.roles.{role}"
        if environment.python is not None and not PurePosixPath(environment.python).is_absolute():
            issues.append(
                ConfigIssue(
                    f"{key}.python",
                    environment.python,
                    "must be an absolute path: Ray starts the role's workers with it on every "
                    "node, from their own working directories",
                    "give the absolute path of the environment's interpreter, e.g. "
                    "/opt/envs/sglang/bin/python",
                )
            )
        if environment.setup_hook is not None and environment.image is not None:
            issues.append(
                ConfigIssue(
                    f"{key}.setup_hook",
                    environment.setup_hook,
                    "Ray takes nothing but env_vars next to an image (runtime_env image_uri)",
                    f"run the hook from the image's own startup, or set {key}.image to null",
                )
            )
        if environment.python is not None and environment.image is not None:
            issues.append(
                ConfigIssue(
                    f"{key}.image",
                    environment.image,
                    f"exclusive with {key}.python: Ray runs an image with the image's own "
                    "interpreter",
                    f"set one of {key}.python and {key}.image to null",
                )
            )
    generation, server = roles.generation, roles.policy_server
    torch_engine = isinstance(config.generation, TorchGenerationConfig)
    if torch_engine and generation.kind is not None:
        issues.append(
            ConfigIssue(
                f"cluster.roles.generation.{generation.kind}",
                generation.python or generation.image,
                "generation=torch has no generation actors: the torch engine runs inside the "
                "policy server",
                f"set cluster.roles.policy_server.{generation.kind} instead, or select "
                "generation=sglang",
            )
        )
    if not torch_engine and server.kind is not None and generation.kind != server.kind:
        outcome = (
            "in the policy server's environment"
            if generation.kind is None
            else "with both an interpreter and an image"
        )
        issues.append(
            ConfigIssue(
                f"cluster.roles.generation.{server.kind}",
                None,
                f"required when cluster.roles.policy_server.{server.kind} is set: the SGLang "
                "servers, which the policy server starts, inherit every runtime_env field they "
                f"do not set themselves, so they would run {outcome}",
                f"give the SGLang environment as cluster.roles.generation.{server.kind} (and "
                f"nothing else there), or set cluster.roles.policy_server.{server.kind}=null",
            )
        )
    return issues


def _episode_error_issues(config: RecipeConfig) -> list[ConfigIssue]:
    """Failures counted as a reward need the reward: every agent's `failed_reward`."""
    if config.env.rollout.on_episode_error != "reward":
        return []
    loss = config.loss
    named = {"loss.episodes": loss.episodes} | {
        f"loss.episodes_per_agent.{agent}": rules
        for agent, rules in loss.episodes_per_agent.items()
    }
    return [
        ConfigIssue(
            f"{key}.failed_reward",
            None,
            "env.rollout.on_episode_error=reward counts a failed episode as a reward, and this "
            "one says none",
            f"set {key}.failed_reward (e.g. 0.0) or env.rollout.on_episode_error=fail",
        )
        for key, rules in named.items()
        if rules.failed_reward is None
    ]


def _overlong_penalty_issues(config: RecipeConfig) -> list[ConfigIssue]:
    """The soft overlong penalty counts back from a limit: its buffer must fit below it."""
    loss = config.loss
    named = {"loss.episodes": loss.episodes} | {
        f"loss.episodes_per_agent.{agent}": rules
        for agent, rules in loss.episodes_per_agent.items()
    }
    issues = []
    for key, rules in named.items():
        buffer = rules.overlong_penalty_buffer_tokens
        limit = rules.overlong_penalty_limit_tokens or config.generation.server.max_tokens_per_turn
        if buffer and buffer >= limit:
            issues.append(
                ConfigIssue(
                    f"{key}.overlong_penalty_buffer_tokens",
                    buffer,
                    f"the penalty's buffer must be below the per-call token limit it counts back "
                    f"from ({limit}: overlong_penalty_limit_tokens, else "
                    "generation.server.max_tokens_per_turn)",
                    f"set {key}.overlong_penalty_buffer_tokens below {limit}",
                )
            )
    return issues


def _stop_on_divergence_issues(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """Stopping a diverged episode keeps only the prefix truncation would train; a shard without
    truncation would instead stop the run at that episode, so nothing is left to save there."""
    if not config.generation.server.stop_on_divergence:
        return []
    return [
        ConfigIssue(
            f"{shard.key_prefix}.{TRUNCATION_KEY}",
            False,
            "generation.server.stop_on_divergence=true ends a diverged episode so that "
            "truncation trains its contiguous prefix; without truncation the first divergence "
            "stops the run",
            f"set {shard.key_prefix}.{TRUNCATION_KEY}=true, or "
            "generation.server.stop_on_divergence=false",
        )
        for shard in shards
        if not shard.postprocess.truncate_noncontiguous_episodes
    ]


def _split_episode_weight_issues(
    config: RecipeConfig, shards: list[GymActorConfig]
) -> list[ConfigIssue]:
    """A split episode is one episode (docs/configuration.md, "What the episode is"), but its
    tail segments are trained as sequences of their own: a loss that weighs or judges each
    sequence as a whole (a per-sequence mean, a sequence-level importance ratio) would count it
    once per segment, on a ratio of part of it. Refused until the loss sees episodes."""
    loss = config.loss
    whole_sequence = {
        "loss.token_level_normalization": (
            False if not loss.token_level_normalization else None,
            "set loss.token_level_normalization=true",
        ),
        "loss.off_policy_correction.mode": (
            loss.off_policy_correction.mode
            if loss.off_policy_correction.mode.startswith("sequence_")
            else None,
            "use a token mode (token_truncate or token_mask)",
        ),
    }
    return [
        ConfigIssue(
            key,
            value,
            f"{shard.key_prefix}.split_noncontiguous_segments="
            f"{shard.postprocess.split_noncontiguous_segments} trains a split episode's tail "
            "segments as sequences of their own, so this would weigh (or judge) the episode once "
            "per segment",
            f"{fix}, or {shard.key_prefix}.split_noncontiguous_segments=0",
        )
        for shard in shards
        if shard.postprocess.split_noncontiguous_segments
        for key, (value, fix) in whole_sequence.items()
        if value is not None
    ]


def _text_only_issues(config: RecipeConfig, shards: list[GymActorConfig]) -> list[ConfigIssue]:
    """A shard without truncation raises at its first non-contiguous episode. Where its clients
    certainly send text only (or the server ignores their ids) and the template probe shows the
    policy's template re-renders such a history differently, that is every multi-turn episode:
    refused here, naming the field that makes the history text only. The probe loads a
    tokenizer, so it runs only for a config it could refuse."""
    honor = config.generation.server.honor_prompt_token_ids
    exposed = {
        shard.shard: (shard, [c for c in shard_clients(config, shard) if c.text_only or not honor])
        for shard in shards
        if not shard.postprocess.truncate_noncontiguous_episodes
    }
    exposed = {name: (shard, clients) for name, (shard, clients) in exposed.items() if clients}
    if not exposed:
        return []
    # Here, not at the top: the probe brings transformers (about a second to import), which
    # validating every other config (recipes/eval.py, recipes/serve.py, sweeps) does without.
    from gymrl.preflight.template_probe import probe_policy

    probe = probe_policy(config.policy, honor_prompt_token_ids=honor)
    broken = probe.text_only.divergence if probe.text_only is not None else None
    if broken is None:
        return []
    template = f"{probe.template} is not append-only for a client that sends text only"
    keep_ids = "the server keeps the token ids clients send back"
    template_fix = (
        "a template that writes earlier turns as they were generated (policy.chat_template)"
    )
    truncation = f"env.nemo_gym.{TRUNCATION_KEY}=true (train each episode's contiguous prefix)"
    if not honor:
        shard_keys = ", ".join(
            f"{shard.key_prefix}.{TRUNCATION_KEY}" for shard, _ in exposed.values()
        )
        return [
            ConfigIssue(
                HONOR_KEY,
                False,
                f"{template} ({broken.describe()}), and with {HONOR_KEY}=false every client's "
                f"history is re-rendered, so with {shard_keys}=false the run stops at its first "
                "multi-turn episode",
                f"set {HONOR_KEY}=true ({keep_ids}), or {truncation}, or use {template_fix}",
            )
        ]
    issues = []
    for shard, clients in exposed.values():
        for client in clients:
            assert client.key is not None  # only a built-in agent is certainly text only
            issues.append(
                ConfigIssue(
                    client.key,
                    False,
                    f"{template} ({broken.describe()}), so with {shard.key_prefix}."
                    f"{TRUNCATION_KEY}=false the run stops at agent {client.name}'s first "
                    "multi-turn episode",
                    f"set {client.key}=true ({keep_ids}), or {truncation}, or use {template_fix}",
                )
            )
    return issues
