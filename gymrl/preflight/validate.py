"""Validate a composed config once, reporting every problem with its key, value and fix.

Two passes, both always run so that one error message lists everything wrong with a config:

1. structure and types: pydantic (`extra="forbid"`) over the whole tree;
2. cross-field rules that no single field can check (`gymrl.preflight.rules`, grouped as the
   schema is: the model's native context (or YaRN) against the episode length, backend pairs
   that cannot refit, GPU budget and parallelism, async GRPO's need for importance sampling, the
   roles' environments, ...), and, per Gym shard, the recipe-only keys and their
   incompatibilities and the agents (built by `nemo_gym_ext.config.build_gym_actor_config`).
   The Gym rules read the raw tree, so they report even when an unrelated field fails pass 1;
   the shards they build are the ones the run uses (`RecipeConfig.gym_shards`): merged and
   validated once. Last, a shard without truncation whose clients send text only is refused when
   the template probe (`gymrl.preflight.template_probe`) shows the template breaks such an
   episode: the run would stop at its first one.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from gymrl.config.schema.env import EnvConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.preflight.rules import (
    cluster,
    env,
    generation,
    loss,
    policy,
    token_capture,
    trainer,
)
from gymrl.preflight.rules import eval as evaluation
from nemo_gym_ext.config import EnvSource, GymActorConfig, build_all_gym_actor_configs
from nemo_gym_ext.config_errors import ConfigError, ConfigIssue

Rule = Callable[[RecipeConfig], list[ConfigIssue]]
ShardRule = Callable[[RecipeConfig, list[GymActorConfig]], list[ConfigIssue]]

# Pass 2's rules (`gymrl.preflight.rules`, a module per schema group), in the order their issues
# are reported.
RULES: tuple[Rule, ...] = (
    policy.tiny_heads_divide_hidden_size,
    policy.pretrained_needs_path,
    policy.router_replay_needs_moe,
    policy.expert_parallelism_divides_experts,
    token_capture.receipt_mode_not_implemented,
    loss.overlong_penalty_below_limit,
    loss.failed_reward_when_failures_are_rewards,
    loss.async_needs_off_policy_correction,
    policy.context_fits,
    policy.yarn_needs_sglang_and_megatron,
    generation.max_tokens_below_context,
    policy.chat_template_exists,
    policy.parsers_known,
    generation.refit_by_the_trainer,
    generation.lora_refit_into_the_engine,
    policy.compute_dtype_needs_a_torch_role,
    policy.sglang_needs_a_checkpoint,
    generation.expert_parallel_divides_tp,
    generation.engines_fit_the_cluster,
    generation.read_back_needs_a_broadcast,
    trainer.supported_by_the_trainer,
    trainer.sequence_parallel_needs_tp,
    trainer.megatron_has_gpus,
    trainer.model_parallel_divides_gpus,
    trainer.expert_group_divides_gpus,
    trainer.expert_parallel_needs_moe,
    trainer.lora_targets_exist,
    trainer.lora_rank_fits_the_targets,
    cluster.role_environments,
    cluster.torch_engine_has_no_generation_role,
    cluster.sglang_servers_set_the_policy_servers_field,
    evaluation.pass_at_k_within_samples,
    evaluation.pass_at_k_positive,
    evaluation.greedy_samples_differ,
    env.server_roots_exist,
)
# Last, the rules that read the Gym shards as the run builds them.
SHARD_RULES: tuple[ShardRule, ...] = (
    env.text_only_history_survives_the_template,
    env.stop_on_divergence_needs_truncation,
    env.split_segments_weigh_the_episode_once,
    env.compaction_agents_need_the_compaction_adapter,
)


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
        issues.extend(issue for rule in RULES for issue in rule(config))
        issues.extend(issue for rule in SHARD_RULES for issue in rule(config, shards))
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
