"""The Gym shard role: one shard's agents (built-in environments it serves itself, a Gym
deployment it launches as child processes, or a running deployment it joins), running GRPO
groups through `nemo_gym_ext.rollout.RolloutCollector` with the shard's own postprocess config.

`RayGroupRunner` is the rollout producer's and the validator's handle on the started shards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray

from gymrl.cluster.placement import Placement, actor_options
from gymrl.cluster.ray_calls import close_actor, wait_for
from gymrl.cluster.session import OnCleanup
from gymrl.config.schema.env import RolloutConfig
from gymrl.config.schema.policy import PolicyConfig
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.generation.server.chat_template import ChatFormat, row_prompt_token_count
from gymrl.model.loading import load_tokenizer
from gymrl.model.tokens import decode_text
from gymrl.run.progress import raise_if_stalled
from gymrl.run.stop import stops_held
from nemo_gym_ext.config import HEAD_SERVER_URL_KEY, GymActorConfig, PolicyAdapter
from nemo_gym_ext.envs.registry import start_builtin_environment
from nemo_gym_ext.gym_launch import PolicyEndpoint, shard_port_range, start_deployment
from nemo_gym_ext.gym_launch import agent_urls as gym_agent_urls
from nemo_gym_ext.rollout import (
    GroupOutcome,
    PromptSize,
    RolloutCollector,
    RolloutSettings,
    UnknownAgentError,
)

_GYM_HTTP_TIMEOUT_S = 30.0
SHARD_CLOSE_S = 30.0
_POLL_S = 0.5


@dataclass(frozen=True)
class GymShardLaunch:
    """Where and how a shard launches its Gym deployment (env.source=gym_launch)."""

    venv: str  # absolute: Ray workers do not share the driver's working directory
    work_dir: str  # this shard's folder in the run directory: Gym's config and log
    host: str  # where Gym's servers listen (loopback on one machine)
    port_range: tuple[int, int]  # this shard's slice of env.gym.port_range
    start_timeout_s: float
    policy_adapter: PolicyAdapter  # env.gym.policy_adapter
    server_roots: tuple[str, ...]  # env.gym.server_roots, absolute


@ray.remote(num_cpus=0)
class GymShard:
    """One Gym shard's agents: built-in environments it serves itself, a Gym deployment it
    launches as its own child processes (env.source=gym_launch, see nemo_gym_ext.gym_launch),
    or the agents of a running deployment it joins (gym_join)."""

    def __init__(
        self,
        actor_config: GymActorConfig,
        rollout: RolloutConfig,
        *,
        policy: PolicyEndpoint,
        model_folder: str,
        launch: GymShardLaunch,
        stop_on_divergence: bool,
        policy_config: PolicyConfig,
    ):
        """`stop_on_divergence`: the policy server withholds answers to diverged requests
        (generation.server.stop_on_divergence), so results may end on a withheld turn.
        `policy_config`: its chat template measures a prompt the policy server refused."""
        tokenizer = load_tokenizer(model_folder)
        chat_format = ChatFormat.from_policy(policy_config, tokenizer)
        # What this actor starts; if the constructor fails half-way, it is stopped before the
        # error leaves (the actor cannot be closed then, only killed).
        with ExitStack() as started:
            if actor_config.source == "gym_launch":
                deployment = start_deployment(
                    actor_config.gym_config,
                    policy=policy,
                    venv=Path(launch.venv),
                    work_dir=Path(launch.work_dir),
                    host=launch.host,
                    port_range=launch.port_range,
                    timeout_s=launch.start_timeout_s,
                    policy_adapter=launch.policy_adapter,
                    server_roots=[Path(root) for root in launch.server_roots],
                )
                started.callback(deployment.stop)
                agent_urls = gym_agent_urls(deployment.head_url, timeout_s=_GYM_HTTP_TIMEOUT_S)
            elif actor_config.source == "gym_join":
                head_url = actor_config.gym_config[HEAD_SERVER_URL_KEY]
                agent_urls = gym_agent_urls(head_url, timeout_s=_GYM_HTTP_TIMEOUT_S)
            else:
                agent_urls = self._builtin_agents(actor_config, policy, started)
            self._collector = RolloutCollector(
                agent_urls,
                actor_config.postprocess,
                RolloutSettings(
                    max_concurrent_rollouts=rollout.max_concurrent_rollouts,
                    run_timeout_s=rollout.run_timeout_s,
                    max_retries=rollout.max_retries,
                    max_result_bytes=rollout.max_result_bytes,
                    retry_backoff_s=rollout.retry_backoff_s,
                    retry_backoff_max_s=rollout.retry_backoff_max_s,
                    server_stops_divergences=stop_on_divergence,
                ),
                vocab_size=len(tokenizer),
                decode=partial(decode_text, tokenizer, skip_special_tokens=False),
                prompt_size=PromptSize(
                    partial(row_prompt_token_count, chat_format=chat_format),
                    policy_config.max_total_sequence_length,
                ),
            )
            self._started = started.pop_all()

    @staticmethod
    def _builtin_agents(
        actor_config: GymActorConfig, policy: PolicyEndpoint, started: ExitStack
    ) -> dict[str, str]:
        agent_urls: dict[str, str] = {}
        for name, spec in actor_config.agents.items():
            if spec.environment is None:
                agent_urls[name] = str(spec.url)
                continue
            environment = start_builtin_environment(
                spec.environment,
                agent_name=name,
                policy_base_url=policy.base_url,
                policy_api_key=policy.api_key,
                options=spec.agent_options(policy_model=policy.model_name),
            )
            started.callback(environment.close)
            agent_urls[name] = environment.agent_url
        return agent_urls

    def agents(self) -> list[str]:
        return self._collector.agents

    async def run_group(self, row: dict[str, Any], num_episodes: int) -> GroupOutcome:
        return await self._collector.run_group(row, num_episodes)

    async def close(self) -> None:
        """Close the HTTP client, then stop what this shard started (environments, Gym)."""
        await self._collector.aclose()
        self._started.close()


def shard_launch(config: RecipeConfig, output_dir: Path, index: int, count: int, shard: str):
    """Shard `index` of `count`'s launch settings (used when env.source=gym_launch)."""
    gym = config.env.gym
    on_cluster = config.cluster.ray_address is not None
    return GymShardLaunch(
        venv=str(Path(gym.venv).resolve()),
        work_dir=str(output_dir / "gym" / shard),
        # On a cluster, agents on other nodes may call this shard's servers.
        host=ray.util.get_node_ip_address() if on_cluster else "127.0.0.1",
        port_range=shard_port_range(index, count, gym.port_range),
        start_timeout_s=gym.start_timeout_s,
        policy_adapter=gym.policy_adapter,
        server_roots=tuple(str(Path(root).resolve()) for root in gym.server_roots),
    )


def start_gym_shards(
    config: RecipeConfig,
    *,
    output_dir: Path,
    policy: PolicyEndpoint,
    model_folder: str,
    placement: Placement,
    group: Any,
    on_cleanup: OnCleanup,
) -> dict[str, Any]:
    """Start one shard actor per entry of `config.gym_shards` and wait for each one's agents;
    the shard actor serving each agent. An agent served by two shards is refused."""
    shards_by_agent: dict[str, Any] = {}
    shard_names: dict[str, str] = {}
    launching = config.env.source == "gym_launch"
    shards = config.gym_shards
    for index, actor in enumerate(shards):
        shard = GymShard.options(**actor_options(placement.gym_shards, 0, group)).remote(
            actor,
            config.env.rollout,
            policy=policy,
            model_folder=model_folder,
            launch=shard_launch(config, output_dir, index, len(shards), actor.shard),
            stop_on_divergence=config.generation.server.stop_on_divergence,
            policy_config=config.policy,
        )
        on_cleanup(
            f"Gym shard {actor.shard!r}",
            lambda shard=shard: close_actor(shard, timeout_s=SHARD_CLOSE_S),
        )
        agents = wait_for(
            shard.agents.remote(),
            timeout_s=config.cluster.ray_start_timeout_s
            + (config.env.gym.start_timeout_s if launching else 0.0),
            what="starting a Gym shard",
        )
        for agent in agents:
            if agent in shards_by_agent:
                raise UnknownAgentError(
                    f"agent {agent!r} is served by Gym shards {shard_names[agent]!r} and "
                    f"{actor.shard!r}; a row's agent must route to exactly one shard"
                )
            shards_by_agent[agent], shard_names[agent] = shard, actor.shard
    return shards_by_agent


class RayGroupRunner:
    """Groups run as `GymShard.run_group` calls on the shard serving the row's agent (the
    producer's and the validator's `GroupRunner`).

    `engine_check` (`GenerationRole.raise_if_engine_failed`) is called for every outcome with
    failed episodes, before the caller counts them: an engine that stopped for good fails every
    episode, and the run should stop with the engine's error, not the agents'."""

    def __init__(
        self,
        shards_by_agent: Mapping[str, Any],
        engine_check: Callable[[], None] | None = None,
    ):
        self._shards = shards_by_agent
        self._engine_check = engine_check

    @property
    def agents(self) -> Collection[str]:
        return self._shards.keys()

    def submit(self, agent: str, row: dict[str, Any], num_episodes: int) -> Any:
        return self._shards[agent].run_group.remote(row, num_episodes)

    def finished(self, running: Sequence[Any], timeout_s: float) -> list[Any]:
        with stops_held():  # validation waits here in the main thread
            done, _ = ray.wait(list(running), num_returns=1, timeout=timeout_s)
        raise_if_stalled()
        return done

    def outcome(self, group: Any) -> GroupOutcome:
        outcome = wait_for(group, timeout_s=_POLL_S, what="a finished group")
        if outcome.failures and self._engine_check is not None:
            self._engine_check()
        return outcome

    def cancel(self, group: Any) -> None:
        ray.cancel(group)
