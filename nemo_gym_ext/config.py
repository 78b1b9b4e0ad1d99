"""Ownership of `env.nemo_gym`: recipe-only postprocess keys, shards, and Gym's own config.

`env.nemo_gym` mixes three kinds of keys (see docs/configuration.md):

* recipe-only postprocess keys, owned by :class:`NemoGymPostprocessConfig` (the one place their
  defaults live) and never forwarded to Gym;
* the sharding key `shards`: each shard's overrides are merged over the base to form one Gym
  actor's config;
* everything else, which is Gym's own global config and is forwarded untouched. The recipe reads
  one key of it, `agents`, typed by :class:`AgentSpec` (a built-in environment or a remote agent).

:func:`build_gym_actor_config` is the single builder of a shard's actor config. It runs at
composition time (from the recipe's validator) so that an incompatible combination fails before
Ray, a model or a GPU is touched, and again when the actors are created.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nemo_gym_ext.config_errors import ConfigError, ConfigIssue
from nemo_gym_ext.envs.agent import AgentOptions
from nemo_gym_ext.envs.registry import ENVIRONMENTS

SHARDS_KEY = "shards"
AGENTS_KEY = "agents"
CONFIG_PATHS_KEY = "config_paths"
HEAD_SERVER_URL_KEY = "head_server_url"
# Where a run's environments come from (env.source): the recipe's built-in environments (or
# agents given by URL), a Gym deployment the recipe launches per shard, or one it joins.
EnvSource = Literal["builtin", "gym_launch", "gym_join"]
# Gym global keys a launched deployment may be given (nemo_gym/global_config.py); everything
# else at the top of env.nemo_gym must be a server block or a recipe key.
GYM_GLOBAL_KEYS = frozenset(
    {
        "server_spinup_timeout_seconds",
        "model_endpoint_readiness_timeout_seconds",
        "uvicorn_timeout_worker_healthcheck",
        "token_id_capture",
        "model_call_capture_dir",
        "observability_enabled",
        "skip_verification",
        "skip_verification_reward",
        "error_on_almost_servers",
        "error_on_agent_without_environment_server",
        "environment_routing_mode",
        "nemo_gym_log_dir",
        "telemetry",
        "verbose",
    }
)
# Gym global keys the recipe sets itself when it launches Gym (nemo_gym_ext.gym_launch).
INJECTED_GYM_KEYS = frozenset(
    {
        "policy_base_url",
        "policy_api_key",
        "policy_model_name",
        "policy_model",
        "head_server",
        "default_host",
        "port_range_low",
        "port_range_high",
        "skip_venv_if_present",
        "uv_venv_dir",
        "ray_head_node_address",
        "dry_run",
    }
)
AGENT_KIND = "responses_api_agents"  # Gym's kind of agent servers
SERVER_KINDS = frozenset(
    {"resources_servers", "responses_api_agents", "responses_api_models", "environment_servers"}
)
# Gym's model servers the recipe may inject as a launched deployment's `policy_model`
# (env.gym.policy_adapter): the vllm_model adapter, or its twin that forwards a compaction
# agent's required_prefix_token_ids (every other model server refuses that field, 422).
PolicyAdapter = Literal["vllm_model", "vllm_model_with_compaction"]
COMPACTION_ADAPTER: PolicyAdapter = "vllm_model_with_compaction"
# The top-level keys each source reads (besides the recipe-only keys, `shards` and, for a
# launched deployment, server blocks).
_SOURCE_KEYS: dict[str, frozenset[str]] = {
    "builtin": frozenset({AGENTS_KEY}),
    "gym_launch": frozenset({CONFIG_PATHS_KEY}) | GYM_GLOBAL_KEYS,
    "gym_join": frozenset({HEAD_SERVER_URL_KEY}),
}
DEFAULT_SHARD_NAME = "default"
ROUTER_REPLAY_KEY = "policy.router_replay.enabled"
# NeMo-RL's switch for token-capture receipt mode: a top-level key of the recipe config.
TOKEN_CAPTURE_KEY = "token_capture.enabled"
# Gym's own training-token capture (nemo_gym/token_id_capture/config.py): a Gym global key.
GYM_TOKEN_ID_CAPTURE_KEY = "token_id_capture"
TRUNCATION_KEY = "truncate_noncontiguous_episodes"


class NemoGymPostprocessConfig(BaseModel):
    """Recipe-only keys of `env.nemo_gym` that steer how Gym results become training data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    truncate_noncontiguous_episodes: bool = Field(
        default=False,
        description=(
            "When an episode's token history stops being contiguous across turns (a turn's "
            "prompt does not start with every earlier prompt delta and generation), drop that "
            "turn and everything after it and train on the contiguous prefix with the episode's "
            "reward. False keeps the hard error. Incompatible with policy.router_replay.enabled, "
            "token_capture.enabled and env.nemo_gym.token_id_capture.enabled."
        ),
    )
    split_noncontiguous_segments: int = Field(
        default=0,
        ge=0,
        description=(
            "With truncate_noncontiguous_episodes=true, keep up to this many contiguous segments "
            "after an episode's divergences as trajectories of their own (each prompted with its "
            "first turn's whole prompt, trained with the episode's advantage; the GRPO baseline "
            "counts the episode once) instead of dropping the tail; turns after the last kept "
            "segment are dropped and counted. 0 drops the whole tail."
        ),
    )
    on_malformed_result: Literal["raise", "mask"] = Field(
        default="raise",
        description=(
            "What to do with a result whose token fields are malformed (missing, mismatched "
            "lengths, NaN log-probabilities, ids outside the vocabulary): 'raise' fails with the "
            "row and field named; 'mask' keeps the reward for GRPO grouping but trains on none "
            "of its tokens and marks it `malformed_sample`."
        ),
    )

    @field_validator("split_noncontiguous_segments")
    @classmethod
    def _split_needs_truncation(cls, value: int, info: ValidationInfo) -> int:
        if value and not info.data.get(TRUNCATION_KEY):
            raise PydanticCustomError(
                "split_without_truncation",
                "split_noncontiguous_segments keeps segments of a tail that only truncation "
                "lets an episode have (without it a divergence stops the run)",
                {"fix": f"set {TRUNCATION_KEY}=true, or split_noncontiguous_segments=0"},
            )
        return value


RECIPE_ONLY_KEYS = frozenset(NemoGymPostprocessConfig.model_fields)
_AGENT_FIX = (
    "set environment: <built-in> (with optional options), or url: http://host:port (a running "
    "NeMo-Gym agent)"
)


class AgentSpec(BaseModel):
    """One entry of `env.nemo_gym.agents`: a built-in environment, or a remote NeMo-Gym agent.

    The one reading of an agent entry: the validator, the dry-run plan, the row generator and
    the Gym shard actor all take this model, never the raw mapping.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: str | None = Field(
        default=None,
        description="A built-in environment the Gym shard serves on loopback "
        "(nemo_gym_ext.envs.registry.ENVIRONMENTS); rows are generated for it when "
        "env.data.train_jsonl is null.",
    )
    options: AgentOptions | None = Field(
        default=None, description="Options of a built-in environment's agent (AgentOptions)."
    )
    url: str | None = Field(
        default=None,
        description="Base URL of a running NeMo-Gym agent server; rows are posted to {url}/run.",
    )

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, value: str | None) -> str | None:
        if value is None or value in ENVIRONMENTS:
            return value
        close = difflib.get_close_matches(value, ENVIRONMENTS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PydanticCustomError(
            "unknown_environment",
            "no built-in environment of that name",
            {"fix": f"{hint}choose one of {sorted(ENVIRONMENTS)}"},
        )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("http://", "https://")):
            raise PydanticCustomError(
                "agent_url", "not an http(s) URL", {"fix": "write url: http://host:port[/path]"}
            )
        return value.rstrip("/")

    @model_validator(mode="after")
    def _builtin_or_remote(self) -> AgentSpec:
        if (self.environment is None) == (self.url is None):
            raise PydanticCustomError(
                "agent_kind",
                "an agent needs exactly one of `environment` (built-in) or `url` (remote)",
                {"fix": _AGENT_FIX},
            )
        if self.url is not None and self.options is not None:
            raise PydanticCustomError(
                "agent_options",
                "`options` configure a built-in environment's agent; a remote agent has its own",
                {"fix": "remove options, or replace url by environment"},
            )
        return self

    def agent_options(self, *, policy_model: str) -> AgentOptions:
        """A built-in agent's options, calling `policy_model` unless the spec names a model."""
        given = self.options.model_dump(exclude_unset=True) if self.options is not None else {}
        return AgentOptions.model_validate({"policy_model": policy_model, **given})

    def describe(self) -> str:
        """What serves the agent, for the plan: the environment's name or the agent's URL."""
        return self.environment if self.environment is not None else str(self.url)


@dataclass(frozen=True)
class GymActorConfig:
    """What one Gym actor (one shard) is started with."""

    shard: str
    source: EnvSource
    postprocess: NemoGymPostprocessConfig
    gym_config: dict[str, Any]  # Gym's own config, `agents` included, as the user wrote it
    # The typed reading of gym_config["agents"] (source builtin); a Gym deployment's agents are
    # known once it runs (nemo_gym_ext.gym_launch).
    agents: dict[str, AgentSpec]
    key_prefix: str  # where this shard's keys are reported: `env.nemo_gym[shard x]`


def describe_shard_agents(actor: GymActorConfig) -> str:
    """What serves a shard's agents, for the plan."""
    if actor.source == "builtin":
        return "agents: " + ", ".join(
            f"{name} ({spec.describe()})" for name, spec in actor.agents.items()
        )
    if actor.source == "gym_join":
        return f"agents of the Gym deployment at {actor.gym_config[HEAD_SERVER_URL_KEY]}"
    blocks = [key for key, value in actor.gym_config.items() if _is_server_block(value)]
    paths = list(actor.gym_config.get(CONFIG_PATHS_KEY) or [])
    compacting = compaction_agents(actor.gym_config)
    compaction = f", compacting their context: {sorted(compacting)}" if compacting else ""
    return (
        f"agents of a launched Gym deployment: config_paths {paths}, inline servers {blocks}"
        f"{compaction}"
    )


def shard_names(nemo_gym: Mapping[str, Any]) -> list[str]:
    """Names of the shards of `env.nemo_gym`; no `shards` key means one shard, `default`."""
    shards = nemo_gym.get(SHARDS_KEY)
    if not shards:
        return [DEFAULT_SHARD_NAME]
    return list(shards)


def build_gym_actor_config(
    nemo_gym: Mapping[str, Any],
    shard: str = DEFAULT_SHARD_NAME,
    *,
    source: EnvSource,
    router_replay_enabled: bool,
    token_capture_enabled: bool,
    key_prefix: str = "env.nemo_gym",
) -> GymActorConfig:
    """Build the actor config of one shard, or raise :class:`ConfigError` naming every problem.

    The shard's overrides (`shards.<shard>`) are merged recursively over the base; the recipe-only
    keys are taken out and validated; the agents are read as :class:`AgentSpec`; compatibility
    with truncation is checked against the run's switches (`router_replay_enabled`,
    `token_capture_enabled`: NeMo-RL's top-level receipt mode) and the shard's own Gym
    capture; the returned Gym config holds neither the recipe-only keys nor
    `shards`. Neither `nemo_gym` nor anything in it is mutated: the result is built from deep
    copies.
    """
    issues: list[ConfigIssue] = []
    merged = _merged_shard_mapping(nemo_gym, shard, key_prefix, issues)
    shard_prefix = _shard_key_prefix(nemo_gym, shard, key_prefix)

    recipe_only = {key: merged.pop(key) for key in list(merged) if key in RECIPE_ONLY_KEYS}
    misspelled = _misspelled_recipe_keys(merged, shard_prefix)
    issues.extend(misspelled)
    postprocess = _validated(NemoGymPostprocessConfig, recipe_only, shard_prefix, issues)
    reported = {issue.key for issue in misspelled}
    issues.extend(
        issue
        for issue in _source_key_issues(merged, source, shard_prefix)
        if issue.key not in reported
    )
    agents = (
        _agents(merged.get(AGENTS_KEY), f"{shard_prefix}.{AGENTS_KEY}", issues)
        if source == "builtin"
        else {}
    )

    if postprocess is not None and postprocess.truncate_noncontiguous_episodes:
        issues.extend(
            _truncation_conflicts(
                merged,
                shard,
                shard_prefix,
                router_replay_enabled=router_replay_enabled,
                token_capture_enabled=token_capture_enabled,
                key_prefix=key_prefix,
            )
        )
    if issues:
        raise ConfigError(issues)
    assert postprocess is not None
    return GymActorConfig(
        shard=shard,
        source=source,
        postprocess=postprocess,
        gym_config=merged,
        agents=agents,
        key_prefix=shard_prefix,
    )


def build_all_gym_actor_configs(
    nemo_gym: Mapping[str, Any],
    *,
    source: EnvSource,
    router_replay_enabled: bool,
    token_capture_enabled: bool,
    key_prefix: str = "env.nemo_gym",
) -> list[GymActorConfig]:
    """Build every shard's actor config; raise one :class:`ConfigError` with all shards' issues."""
    actors: list[GymActorConfig] = []
    issues: list[ConfigIssue] = []
    for name in shard_names(nemo_gym):
        try:
            actors.append(
                build_gym_actor_config(
                    nemo_gym,
                    name,
                    source=source,
                    router_replay_enabled=router_replay_enabled,
                    token_capture_enabled=token_capture_enabled,
                    key_prefix=key_prefix,
                )
            )
        except ConfigError as error:
            issues.extend(error.issues)
    issues.extend(_agents_served_twice(actors))
    if issues:
        raise ConfigError(issues)
    return actors


def _agents_served_twice(actors: list[GymActorConfig]) -> list[ConfigIssue]:
    """A row's agent_ref must route to exactly one shard."""
    issues = []
    owner: dict[str, str] = {}
    for actor in actors:
        for name in actor.agents:
            if name in owner:
                issues.append(
                    ConfigIssue(
                        f"{actor.key_prefix}.{AGENTS_KEY}.{name}",
                        actor.gym_config[AGENTS_KEY][name],
                        f"agent {name!r} is served by shards {owner[name]!r} and {actor.shard!r}",
                        "serve each agent from one shard so rows route unambiguously",
                    )
                )
            owner.setdefault(name, actor.shard)
    return issues


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge returning new containers; nested mappings merge, everything else replaces."""
    merged: dict[str, Any] = {key: copy.deepcopy(value) for key, value in base.items()}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merged_shard_mapping(
    nemo_gym: Mapping[str, Any], shard: str, key_prefix: str, issues: list[ConfigIssue]
) -> dict[str, Any]:
    base = {key: value for key, value in nemo_gym.items() if key != SHARDS_KEY}
    shards = nemo_gym.get(SHARDS_KEY)
    if not shards:
        if shard != DEFAULT_SHARD_NAME:
            raise KeyError(f"{key_prefix} has no shards; the only shard is {DEFAULT_SHARD_NAME!r}")
        return deep_merge(base, {})
    if not isinstance(shards, Mapping):
        issues.append(
            ConfigIssue(
                f"{key_prefix}.{SHARDS_KEY}",
                shards,
                "must be a mapping of shard name to overrides",
                f"write {key_prefix}.{SHARDS_KEY}: {{<name>: {{<overrides>}}}}",
            )
        )
        return deep_merge(base, {})
    if shard not in shards:
        raise KeyError(f"{key_prefix}.{SHARDS_KEY} has no shard {shard!r}; shards: {list(shards)}")
    overrides = shards[shard]
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        issues.append(
            ConfigIssue(
                f"{key_prefix}.{SHARDS_KEY}.{shard}",
                overrides,
                "shard overrides must be a mapping",
                "use {} for a shard with no overrides",
            )
        )
        overrides = {}
    if SHARDS_KEY in overrides:
        issues.append(
            ConfigIssue(
                f"{key_prefix}.{SHARDS_KEY}.{shard}.{SHARDS_KEY}",
                overrides[SHARDS_KEY],
                "shards cannot be nested",
                "declare every shard under the base's shards",
            )
        )
        overrides = {key: value for key, value in overrides.items() if key != SHARDS_KEY}
    return deep_merge(base, overrides)


def _shard_key_prefix(nemo_gym: Mapping[str, Any], shard: str, key_prefix: str) -> str:
    if nemo_gym.get(SHARDS_KEY):
        return f"{key_prefix}[shard {shard}]"
    return key_prefix


def _agents(raw: Any, key: str, issues: list[ConfigIssue]) -> dict[str, AgentSpec]:
    """Each agent of a shard as an :class:`AgentSpec`; what is wrong goes to `issues`."""
    if not isinstance(raw, Mapping) or not raw:
        issues.append(
            ConfigIssue(
                key,
                raw,
                "a shard must serve at least one agent",
                "add env.nemo_gym.agents.<name>: {environment: <built-in>} or {url: <agent "
                "server>}",
            )
        )
        return {}
    agents = {}
    for name, spec in raw.items():
        agent = _validated(AgentSpec, spec, f"{key}.{name}", issues)
        if agent is not None:
            agents[str(name)] = agent
    return agents


_Model = TypeVar("_Model", bound=BaseModel)


def _validated(
    model: type[_Model], raw: Any, prefix: str, issues: list[ConfigIssue]
) -> _Model | None:
    """`model` validated from `raw`, or None with one issue per pydantic error in `issues`."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        for detail in error.errors():
            loc = tuple(str(part) for part in detail["loc"])
            unknown = detail["type"] == "extra_forbidden"
            issues.append(
                ConfigIssue(
                    ".".join((prefix, *loc)),
                    detail.get("input"),
                    "unknown key" if unknown else detail["msg"],
                    _fix(model, loc, detail),
                )
            )
        return None


def _fix(model: type[BaseModel], loc: tuple[str, ...], detail: Mapping[str, Any]) -> str:
    """The fix of one pydantic error: the validator's own, a near name, or the field's meaning."""
    own = (detail.get("ctx") or {}).get("fix")
    if own:
        return own
    if not loc:  # the object as a whole: only an agent entry can be wrong that way
        return _AGENT_FIX
    name = loc[-1]
    # An agent entry nests one model, its options; every other field is a scalar.
    owner = AgentOptions if model is AgentSpec and len(loc) > 1 else model
    if detail["type"] == "extra_forbidden":
        known = list(owner.model_fields)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return f"did you mean {close[0]!r}?" if close else f"known keys: {sorted(known)}"
    info = owner.model_fields.get(name)
    if info is None:
        return f"use one of {sorted(owner.model_fields)}"
    if info.annotation is bool:
        return "set true or false"
    return info.description or f"use a value of type {info.annotation}"


def _misspelled_recipe_keys(gym_keys: Mapping[str, Any], shard_prefix: str) -> list[ConfigIssue]:
    """Gym keys pass through untyped, so a typo of a recipe-only key would be silently forwarded
    to Gym and the option would do nothing. Catch near-misses by name."""
    issues = []
    for key in gym_keys:
        close = difflib.get_close_matches(key, RECIPE_ONLY_KEYS, n=1, cutoff=0.85)
        if close:
            issues.append(
                ConfigIssue(
                    f"{shard_prefix}.{key}",
                    gym_keys[key],
                    f"unknown key, close to the recipe-only key {close[0]!r} (it would be "
                    "forwarded to Gym and ignored)",
                    f"rename it to {close[0]}",
                )
            )
    return issues


def _source_key_issues(
    gym_keys: Mapping[str, Any], source: str, shard_prefix: str
) -> list[ConfigIssue]:
    """Keys of a shard's Gym config that its source does not read: an error rather than a key
    silently forwarded and ignored. A launched deployment also takes server blocks
    (`<name>: {<server kind>: {<server>: {...}}}`) and the Gym globals the recipe does not set."""
    issues = []
    known = _SOURCE_KEYS[source]
    for key, value in gym_keys.items():
        if key in known or (source == "gym_launch" and _is_server_block(value)):
            continue
        if source == "gym_launch" and key in INJECTED_GYM_KEYS:
            issues.append(
                ConfigIssue(
                    f"{shard_prefix}.{key}",
                    value,
                    "the recipe sets this Gym key itself when it launches Gym (the policy "
                    "server's URL, key and model name, the head server's address, Gym's venv)",
                    "remove it; see docs/environments.md",
                )
            )
            continue
        others = [other for other, keys in _SOURCE_KEYS.items() if key in keys]
        if others:
            fix = f"select env={others[0]} for it, or remove it"
        else:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
            fix = f"did you mean {close[0]!r}?" if close else f"known keys: {sorted(known)}"
            if source == "gym_launch":
                fix += f"; a server block is <name>: {{<one of {sorted(SERVER_KINDS)}>: {{...}}}}"
        issues.append(
            ConfigIssue(
                f"{shard_prefix}.{key}",
                value,
                f"unknown key for env.source={source} (it would be ignored)",
                fix,
            )
        )
    if source == "gym_launch" and not (
        gym_keys.get(CONFIG_PATHS_KEY) or any(_is_server_block(v) for v in gym_keys.values())
    ):
        issues.append(
            ConfigIssue(
                f"{shard_prefix}.{CONFIG_PATHS_KEY}",
                gym_keys.get(CONFIG_PATHS_KEY),
                "a launched Gym deployment needs its servers",
                "list Gym config files in config_paths (e.g. resources_servers/<env>/configs/"
                "<env>.yaml) or give inline server blocks",
            )
        )
    if source == "gym_join" and not isinstance(gym_keys.get(HEAD_SERVER_URL_KEY), str):
        issues.append(
            ConfigIssue(
                f"{shard_prefix}.{HEAD_SERVER_URL_KEY}",
                gym_keys.get(HEAD_SERVER_URL_KEY),
                "joining a Gym deployment needs its head server's URL",
                "set head_server_url: http://host:port (the deployment's head_server)",
            )
        )
    return issues


def compaction_agents(gym_config: Mapping[str, Any]) -> dict[str, str]:
    """The agents among `gym_config`'s server blocks that compact their context, by name, with
    their server (`simple_agent_with_compaction` or an agent built on it): those whose config
    turns on `context_history.enabled`. Such an agent sends `required_prefix_token_ids` on every
    model call, so its model server must forward it."""
    found = {}
    for name, block in gym_config.items():
        if not _is_server_block(block) or AGENT_KIND not in block:
            continue
        # ng_run starts the first server of a block (nemo_gym/cli/env.py).
        for server, settings in list(block[AGENT_KIND].items())[:1]:
            history = settings.get("context_history") if isinstance(settings, Mapping) else None
            if isinstance(history, Mapping) and history.get("enabled") is True:
                found[str(name)] = str(server)
    return found


def _is_server_block(value: Any) -> bool:
    if not isinstance(value, Mapping) or len(value) != 1:
        return False
    (kind, servers), *_ = value.items()
    return kind in SERVER_KINDS and isinstance(servers, Mapping)


def _truncation_conflicts(
    gym_config: Mapping[str, Any],
    shard: str,
    shard_prefix: str,
    *,
    router_replay_enabled: bool,
    token_capture_enabled: bool,
    key_prefix: str,
) -> list[ConfigIssue]:
    """What truncation cannot coexist with in one shard: router replay, and token capture, where
    the episode's tokens come from a capture record (NeMo-RL's receipt mode, or Gym's own
    `token_id_capture`) rather than from the contiguity walk, so truncating would silently do
    nothing."""
    issues = []
    truncation_key = f"{shard_prefix}.{TRUNCATION_KEY}"
    truncation_fix = f"{key_prefix}.{TRUNCATION_KEY}=false"
    conflict = f"incompatible with {truncation_key}=true (shard {shard!r})"
    if router_replay_enabled:
        issues.append(
            ConfigIssue(
                ROUTER_REPLAY_KEY,
                True,
                f"{conflict}: router replay needs "
                "the next contiguous prompt's prefill to repair the retained prefix's final route",
                f"set {ROUTER_REPLAY_KEY}=false or {truncation_fix}",
            )
        )
    capture = (
        "token capture bypasses the token-prefix check, so truncation would silently do nothing"
    )
    if token_capture_enabled:
        issues.append(
            ConfigIssue(
                TOKEN_CAPTURE_KEY,
                True,
                f"{conflict}: receipt-mode {capture}",
                f"set {TOKEN_CAPTURE_KEY}=false or {truncation_fix}",
            )
        )
    gym_capture = gym_config.get(GYM_TOKEN_ID_CAPTURE_KEY)
    if isinstance(gym_capture, Mapping) and gym_capture.get("enabled") is True:
        gym_key = f"{shard_prefix}.{GYM_TOKEN_ID_CAPTURE_KEY}.enabled"
        issues.append(
            ConfigIssue(
                gym_key,
                True,
                f"{conflict}: Gym's training-{capture}",
                f"set {gym_key}=false or {truncation_fix}",
            )
        )
    return issues
