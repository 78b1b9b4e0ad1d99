"""The Ray actors of async GRPO, each with one narrow job.

* :class:`GenerationServer`: a generation engine (torch, or a group of SGLang servers) behind the
  OpenAI-compatible policy model server (the URL Gym agents call); refit with a weight version.
* :class:`GymShard`: one Gym shard: starts its built-in environments (or points at remote agents)
  and runs GRPO groups through :class:`nemo_gym_ext.rollout.RolloutCollector`, postprocessing each
  result with the shard's own postprocess config.
* :class:`PolicyTrainerActor`: the trainer (optimizer steps, weight export, checkpoints).
* the replay buffer: `gymrl.replay_buffer.ReplayBuffer` as a threaded actor.

What each actor reserves (GPUs, CPUs, its placement bundle) is decided by `gymrl.placement` and
given with `.options(...)` where the actor is created; the decorators' `num_cpus=0` is what an
actor without options gets.

:func:`close_actor` ends any of them: its own `close()` first where it has one (servers stop,
engine subprocesses exit), then its process is killed, so nothing outlives the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
from pydantic import SecretStr

from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema import (
    LossConfig,
    PolicyConfig,
    RecipeConfig,
    RefitConfig,
    RolloutConfig,
    SGLangGenerationConfig,
    TorchTrainerConfig,
)
from gymrl.generation.announce import policy_server_host
from gymrl.generation.chat_template import ChatFormat
from gymrl.generation.policy_server import create_policy_server_app
from gymrl.generation.sglang_engine import SGLangEngine, SGLangServerGroup
from gymrl.generation.torch_engine import TorchGenerationEngine
from gymrl.generation.weight_sync import WeightSender
from gymrl.model.loading import load_tokenizer
from gymrl.model.tokens import decode_text, eos_token_id, pad_token_id
from gymrl.placement import Placement
from gymrl.policy import build_policy, tokenizer_folder
from gymrl.ray_calls import wait_for
from gymrl.replay_buffer import ReplayBuffer
from gymrl.trainer.torch_trainer import TorchPolicyTrainer
from nemo_gym_ext.config import HEAD_SERVER_URL_KEY, GymActorConfig
from nemo_gym_ext.envs.registry import start_builtin_environment
from nemo_gym_ext.gym_launch import PolicyEndpoint, start_deployment
from nemo_gym_ext.gym_launch import agent_urls as gym_agent_urls
from nemo_gym_ext.http_server import serve_in_thread
from nemo_gym_ext.rollout import GroupOutcome, RolloutCollector, RolloutSettings

_GYM_HTTP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GymShardLaunch:
    """Where and how a shard launches its Gym deployment (env.source=gym_launch)."""

    venv: str  # absolute: Ray workers do not share the driver's working directory
    work_dir: str  # this shard's folder in the run directory: Gym's config and log
    host: str  # where Gym's servers listen (loopback on one machine)
    port_range: tuple[int, int]  # this shard's slice of env.gym.port_range
    start_timeout_s: float


@ray.remote(num_cpus=0)
class GenerationServer:
    """The policy model server in front of the configured engine (torch, or SGLang servers)."""

    def __init__(
        self,
        config: RecipeConfig,
        *,
        output_dir: str,
        torch_threads: int,
        placement: Placement,
        placement_group: Any,
        api_key: SecretStr,
    ):
        """`placement` says where the engines run (the torch engine: on this actor's GPU, if it
        has one); SGLang servers go into bundles of `placement_group`. `api_key` is the run's
        (`gymrl.generation.api_key`)."""
        torch.set_num_threads(torch_threads)
        policy, generation = config.policy, config.generation
        # What this actor starts, closed in reverse by close(); if the constructor fails
        # half-way, the SGLang servers it started are shut down before the error leaves.
        with ExitStack() as started:
            if isinstance(generation, SGLangGenerationConfig):
                tokenizer = load_tokenizer(tokenizer_folder(policy))
                sglang_servers = SGLangServerGroup(
                    generation,
                    policy,
                    model_path=tokenizer_folder(policy),
                    seed=config.run.seed,
                    log_dir=Path(output_dir) / "logs",
                    placement_group=placement_group,
                    engines=placement.generation,
                )
                started.callback(sglang_servers.shutdown)
                self._engine = SGLangEngine.from_config(
                    generation, sglang_servers.urls, refit_dir=Path(output_dir) / "refit"
                )
                started.callback(self._engine.close)
                self._tp_size = generation.tensor_parallel_size
                batching = {}  # SGLang schedules each request itself: nothing is batched
            else:
                model, tokenizer = build_policy(policy, config.run.seed)
                # transformers' `to` is typed as unbound (see gymrl.model.loading.build_tiny_llama).
                model.to(placement.generation.device)  # pyright: ignore[reportArgumentType]
                self._engine = TorchGenerationEngine(
                    model,
                    max_batch_size=generation.max_batch_size,
                    eos_token_ids=[eos_token_id(tokenizer)],
                    seed=config.run.seed,
                    compute_dtype=policy.compute_dtype,
                )
                batching = {
                    "max_batch_size": generation.max_batch_size,
                    "max_concurrent_batches": generation.server.max_concurrent_batches,
                }
            server = generation.server
            app = create_policy_server_app(
                self._engine,
                ChatFormat.from_policy(policy, tokenizer),
                model_name=policy.name,
                api_key=api_key,
                honor_prompt_token_ids=server.honor_prompt_token_ids,
                default_max_tokens=server.max_tokens_per_turn,
                max_context_tokens=policy.max_total_sequence_length,
                request_timeout_s=server.request_timeout_s,
                **batching,
            )
            http_server = serve_in_thread(
                app,
                host=policy_server_host(config),
                port=server.port,
                max_body_bytes=server.max_request_bytes,
                max_concurrency=server.max_concurrent_requests,
            )
            # A running engine batch finishes first.
            started.callback(http_server.close, timeout_s=50.0)
            self._public_url = http_server.url.replace("0.0.0.0", ray.util.get_node_ip_address())
            self._started = started.pop_all()

    def base_url(self) -> str:
        """The OpenAI base URL agents use (`.../v1`)."""
        return f"{self._public_url}/v1"

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        self._engine.update_weights(state_dict, version)
        return self._engine.weight_version

    def weight_sync_targets(self) -> tuple[list[str], list[int]]:
        """The SGLang servers' URLs and TP sizes, for the trainer's `WeightSender`."""
        engine = self._sglang_engine()
        return engine.server_urls, [self._tp_size] * len(engine.server_urls)

    def begin_refit(self) -> None:
        """Pause the SGLang servers while the trainer broadcasts weights to them."""
        self._sglang_engine().begin_refit()

    def end_refit(self, version: int) -> int:
        self._sglang_engine().end_refit(version)
        return version

    def _sglang_engine(self) -> SGLangEngine:
        if not isinstance(self._engine, SGLangEngine):  # the validator refuses such configs
            raise TypeError("weight sync by broadcast is the SGLang engines' (generation=sglang)")
        return self._engine

    def refit_from_disk(self, path: str, version: int) -> int:
        """SGLang engines load a Hugging Face checkpoint the trainer exported to shared disk."""
        if not isinstance(self._engine, SGLangEngine):  # the validator refuses such configs
            raise TypeError("refit_from_disk is the SGLang engines' refit path (generation=sglang)")
        self._engine.refit_from_disk(path, version)
        return self._engine.weight_version

    def close(self) -> None:
        """Stop the HTTP server, then the SGLang engines behind it (each even if one fails)."""
        self._started.close()


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
        tokenizer_folder: str,
        launch: GymShardLaunch,
    ):
        tokenizer = load_tokenizer(tokenizer_folder)
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
                ),
                vocab_size=len(tokenizer),
                decode=partial(decode_text, tokenizer, skip_special_tokens=False),
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


@ray.remote(num_cpus=0)
class PolicyTrainerActor:
    def __init__(
        self,
        policy: PolicyConfig,
        trainer: TorchTrainerConfig,
        loss: LossConfig,
        *,
        seed: int,
        temperature: float,
        keep_last_checkpoints: int,
        torch_threads: int,
        device: str,
    ):
        """`device`: `cuda` when the placement gave this actor a GPU (Ray makes it the only
        visible one), else `cpu`."""
        torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)
        self._device = device
        self._sender: WeightSender | None = None
        model, tokenizer = build_policy(policy, seed)
        # transformers' `to` is typed as unbound (see gymrl.model.loading.build_tiny_llama).
        model.to(device)  # pyright: ignore[reportArgumentType]
        self._trainer = TorchPolicyTrainer(
            model,
            trainer,
            loss,
            temperature=temperature,
            pad_token_id=pad_token_id(tokenizer),
            keep_last_checkpoints=keep_last_checkpoints,
            compute_dtype=policy.compute_dtype,
        )

    def train_step(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> dict:
        return self._trainer.train_step(trajectories, advantages)

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return self._trainer.export_weights()

    def send_weights(
        self, urls: list[str], tp_sizes: list[int], refit: RefitConfig, version: int
    ) -> int:
        """Broadcast the weights to the SGLang servers (paused by the generation server); the
        weight-update group is formed on the first call and kept."""
        if self._sender is None:
            self._sender = WeightSender(
                urls,
                tp_sizes,
                master_address=ray.util.get_node_ip_address(),
                backend="nccl" if self._device.startswith("cuda") else "gloo",
                bucket_bytes=refit.bucket_bytes,
                timeout_s=refit.timeout_s,
            )
        self._sender.send(self._trainer.export_weights().items(), version)
        return self._sender.bytes_sent

    def weight_version(self) -> int:
        return self._trainer.weight_version

    def save_checkpoint(self, directory: str, step: int, data_state: dict) -> str:
        return str(self._trainer.save_checkpoint(Path(directory), step, data_state))

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self._trainer.load_checkpoint(Path(path))


# A threaded actor: Ray's typed overload of remote(...) leaves out the actor-only max_concurrency.
ReplayBufferActor = ray.remote(num_cpus=0, max_concurrency=4)(ReplayBuffer)  # pyright: ignore[reportCallIssue]


def close_actor(actor: Any, *, timeout_s: float | None = None) -> None:
    """End `actor`: with `timeout_s`, first its `close()` within that deadline; then, whether or
    not that worked (an actor whose constructor failed cannot close), kill its process."""
    try:
        if timeout_s is not None:
            wait_for(actor.close.remote(), timeout_s=timeout_s, what="closing an actor")
    finally:
        ray.kill(actor)
