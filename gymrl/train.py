"""The async GRPO loop: a rollout producer feeding a replay buffer, a trainer draining it.

    producer thread ──run_group──▶ GymShard actors ──/run──▶ agents ──/chat/completions──▶
    GenerationServer;  completed groups ──put──▶ ReplayBuffer ──get_batch──▶ trainer step
    ──export_weights──▶ GenerationServer.update_weights (version = step count)

Async (`grpo.async_enabled`): the producer may run `max_trajectory_age_steps` steps ahead of the
trainer, so generation overlaps training; the buffer evicts groups older than that bound. Sync:
the producer makes exactly one step's groups, then waits for the trainer and the refit.

Nothing waits without a deadline: the trainer's wait for a batch is bounded by
`grpo.batch_timeout_s`; every episode by `env.rollout.run_timeout_s`. A failed episode is retried
`env.rollout.max_retries` times, then counted against `env.rollout.failure_budget`; past it, or on
a contiguity/malformed-result error (never retried), the run stops with the cause.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from gymrl.actors import GenerationServer, GymShard, ReplayBufferActor
from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.trajectory import Trajectory
from gymrl.checkpoint import latest_checkpoint
from gymrl.config.schema import RecipeConfig
from gymrl.config.validate import gym_actor_configs
from gymrl.data import RowStream, load_rows
from gymrl.metrics_logger import METRICS_FILENAME, build_logger
from gymrl.placement import actor_options, plan_placement, reserve
from gymrl.plot import plot_run, read_records
from gymrl.policy import tokenizer_folder
from gymrl.ray_calls import wait_for
from gymrl.roles import build_trainer_role
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import (
    MalformedGymResultError,
    NonContiguousEpisodeError,
    agent_name_of,
    row_id_of,
)
from nemo_gym_ext.rollout import FailureBudget, RolloutBudgetExceeded, UnknownAgentError

_POLL_S = 0.5
_CALL_MARGIN_S = 60.0  # on top of a callee's own deadline: Ray scheduling and transfer


def _start_timeout_s(config: RecipeConfig) -> float:
    """Deadline for the generation server: model loading, plus SGLang's own start deadline."""
    generation = config.generation
    engines = generation.server_start_timeout_s if generation.backend == "sglang" else 0.0
    return config.cluster.ray_start_timeout_s + engines


_ADVANTAGE_EPS = 1e-6


class ClusterUnavailableError(RuntimeError):
    """The configured Ray cluster cannot be reached."""


# Errors that end a run with a message a user can act on (printed without a traceback).
RUN_STOPPING_ERRORS = (
    ClusterUnavailableError,
    NonContiguousEpisodeError,
    MalformedGymResultError,
    UnknownAgentError,
    RolloutBudgetExceeded,
    TimeoutError,
)


@dataclass
class _ProducerStats:
    retries: int = 0
    dropped_groups: int = 0
    group_seconds: list[float] = field(default_factory=list)


class RolloutProducer(threading.Thread):
    """Submits rows to Gym shards within a credit limit and puts completed groups in the buffer.

    Credits: the trainer allows groups up to `(step + 1 + lookahead) * prompts_per_step`, so the
    producer never runs further ahead than the trajectory-age bound makes useful.
    """

    def __init__(
        self,
        config: RecipeConfig,
        rows: RowStream,
        shards_by_agent: Mapping[str, Any],
        buffer: Any,
        first_step: int,
    ):
        super().__init__(name="rollout-producer", daemon=True)
        self._config = config
        self._rows = rows
        self._shards = shards_by_agent
        self._buffer = buffer
        grpo = config.grpo
        self._lookahead = grpo.max_trajectory_age_steps if grpo.async_enabled else 0
        self._condition = threading.Condition()
        self._first_step = first_step
        self._weight_version = first_step
        self._allowed = self._credit(first_step)
        self._accepted = 0
        self._stopping = threading.Event()
        self.fatal: BaseException | None = None
        self.stats = _ProducerStats()
        self.failures = FailureBudget(config.env.rollout.failure_budget)
        self.summaries: dict[str, list[dict[str, Any]]] = {}
        self._serial = 0

    def _credit(self, step: int) -> int:
        """Groups the buffer may have received once the trainer has taken `step` steps."""
        steps_allowed = step - self._first_step + 1 + self._lookahead
        return steps_allowed * self._config.grpo.num_prompts_per_step

    def advance(self, step: int, evicted_total: int) -> None:
        """The trainer finished `step` steps and refit the engine: version `step` is live.
        Evicted groups were never trained on, so they are replaced."""
        with self._condition:
            self._weight_version = step
            self._allowed = self._credit(step) + evicted_total
            self._condition.notify_all()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop submitting, cancel the groups in flight, and wait for the thread to end."""
        self._stopping.set()
        with self._condition:
            self._condition.notify_all()
        self.join(timeout_s)

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as error:  # handed to the trainer's thread, which raises it
            self.fatal = error

    def _produce(self) -> None:
        in_flight: dict[Any, tuple[str, int, float]] = {}
        try:
            self._submit_and_collect(in_flight)
        finally:
            for future in in_flight:
                ray.cancel(future)

    def _submit_and_collect(self, in_flight: dict[Any, tuple[str, int, float]]) -> None:
        size = self._config.grpo.num_generations_per_prompt
        while not self._stopping.is_set():
            with self._condition:
                room = self._allowed - self._accepted - len(in_flight)
                version = self._weight_version
            for _ in range(max(room, 0)):
                position, row = self._rows.next()
                agent = agent_name_of(row)
                if agent not in self._shards:
                    raise UnknownAgentError(
                        f"row {position} ({row_id_of(row)!r}) names agent {agent!r}, which no "
                        f"shard serves (served: {sorted(self._shards)}); fix the row's "
                        "agent_ref.name or env.nemo_gym.agents"
                    )
                self._serial += 1
                group_id = f"{row_id_of(row)}#{self._serial}"
                future = self._shards[agent].run_group.remote(row, size)
                in_flight[future] = (group_id, version, time.monotonic())
            if not in_flight:
                with self._condition:
                    self._condition.wait(_POLL_S)
                continue
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=_POLL_S)
            for future in done:
                group_id, version, started = in_flight.pop(future)
                # Contiguity and malformed-result errors propagate from here.
                outcome = wait_for(future, timeout_s=_POLL_S, what=f"group {group_id}")
                self.stats.group_seconds.append(time.monotonic() - started)
                self._accept(outcome, group_id, version)

    def _accept(self, outcome: Any, group_id: str, version: int) -> None:
        stats = self.stats
        stats.retries += outcome.retries
        self.failures.record(outcome.failures)
        if len(outcome.episodes) < 2:
            stats.dropped_groups += 1  # no baseline without two episodes; another row replaces it
            return
        group = [
            Trajectory.from_postprocessed(episode, group_id=group_id, weight_version=version)
            for episode in outcome.episodes
        ]
        self.summaries[group_id] = [_scalar_fields(e["full_result"]) for e in outcome.episodes]
        # A group the buffer finds already stale counts as delivered: the trainer's eviction
        # count, passed to `advance`, is what gives its credit back.
        timeout_s = self._config.grpo.batch_timeout_s
        wait_for(
            self._buffer.put.remote(group, timeout_s),
            timeout_s=timeout_s + _CALL_MARGIN_S,
            what="putting a group into the replay buffer",
        )
        with self._condition:
            self._accepted += 1


def run_grpo(config: RecipeConfig, output_dir: Path) -> None:
    """Run the whole training job described by `config`, writing into `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    cluster = config.cluster
    try:
        ray.init(
            address=cluster.ray_address,
            num_cpus=cluster.cpus_per_node if cluster.ray_address is None else None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    except ConnectionError as error:
        raise ClusterUnavailableError(
            f"cluster.ray_address={cluster.ray_address!r} but no Ray cluster answers ({error}). "
            "On Slurm, start the run with launch/ray.sub, which starts Ray first; on one machine, "
            "use cluster=local_cpu."
        ) from None
    try:
        GRPOLoop(config, output_dir).run()
    finally:
        ray.shutdown()


class GRPOLoop:
    def __init__(self, config: RecipeConfig, output_dir: Path):
        self.config = config
        self.output_dir = output_dir
        self.checkpoint_dir = output_dir / "checkpoints"
        # Async on a CPU: generation and training overlap, one core each; sync: they alternate.
        threads = 1 if config.grpo.async_enabled else 2
        folder = tokenizer_folder(config.policy)  # converts the embedded model once, here
        placement = plan_placement(config)
        group = reserve(placement, config.cluster.ray_start_timeout_s)
        self.generation = GenerationServer.options(
            **actor_options(placement.policy_server, 0, group)
        ).remote(
            config,
            output_dir=str(output_dir),
            torch_threads=threads,
            placement=placement,
            placement_group=group,
        )
        base_url = wait_for(
            self.generation.base_url.remote(),
            timeout_s=_start_timeout_s(config),
            what="starting the generation server",
        )
        print(f"policy server (OpenAI base URL for Gym agents): {base_url}", flush=True)
        self.trainer = build_trainer_role(config, output_dir, threads, placement, group)
        self.actor_configs = gym_actor_configs(config)
        self.shards = {
            actor.shard: GymShard.options(**actor_options(placement.gym_shards, 0, group)).remote(
                actor,
                config.env.rollout,
                policy_base_url=base_url,
                policy_api_key=config.generation.server.api_key,
                policy_model=config.policy.name,
                tokenizer_folder=folder,
            )
            for actor in self.actor_configs
        }
        self.shards_by_agent = {
            agent: shard
            for shard in self.shards.values()
            for agent in wait_for(
                shard.agents.remote(),
                timeout_s=config.cluster.ray_start_timeout_s,
                what="starting a Gym shard",
            )
        }
        grpo = config.grpo
        capacity = (grpo.max_trajectory_age_steps + 2) * grpo.num_prompts_per_step
        self.buffer = ReplayBufferActor.options(**actor_options(placement.buffer, 0, group)).remote(
            grpo.max_trajectory_age_steps, capacity
        )

    def run(self) -> None:
        config, grpo = self.config, self.config.grpo
        first_step, position = self._resume()
        self._refit(first_step)
        rows = RowStream(
            load_rows(
                config.env.data, self.actor_configs, config.generation.sampling, config.run.seed
            ),
            position,
        )
        producer = RolloutProducer(config, rows, self.shards_by_agent, self.buffer, first_step)
        logger = build_logger(
            config.logger,
            run_name=config.run.name,
            output_dir=self.output_dir,
            hparams=config.model_dump(mode="json"),
            total_steps=grpo.num_steps,
            first_step=first_step,
        )
        producer.start()
        try:
            last = time.monotonic()
            for step in range(first_step, grpo.num_steps):
                metrics = self._step(step, producer)
                now = time.monotonic()
                metrics["timing/step_s"] = now - last
                last = now
                if (
                    config.checkpoint.every_n_steps
                    and (step + 1) % config.checkpoint.every_n_steps == 0
                ):
                    started = time.monotonic()
                    self.trainer.save_checkpoint(
                        self.checkpoint_dir, step + 1, {"position": rows.position}
                    )
                    metrics["timing/checkpoint_s"] = time.monotonic() - started
                logger.log(step + 1, metrics)
        finally:
            producer.stop()
            logger.close()
            self._close_servers()
        if config.logger.jsonl:
            metrics = self.output_dir / METRICS_FILENAME
            picture = plot_run(read_records(metrics), metrics.with_suffix(".png"), config.run.name)
            print(f"metrics: {metrics}\npicture: {picture}", flush=True)

    def _close_servers(self) -> None:
        """Agents first (they call the policy server), then the policy server. Best effort: a
        failure here must not mask the error that ended the run."""
        try:
            ray.get([shard.close.remote() for shard in self.shards.values()], timeout=30)
            ray.get(self.generation.close.remote(), timeout=60)
        except Exception as error:  # reported; ray.shutdown() then ends the actors
            print(f"warning: servers did not close cleanly: {error}", flush=True)

    def _resume(self) -> tuple[int, int]:
        if not self.config.resume:
            return 0, 0
        checkpoint = latest_checkpoint(self.checkpoint_dir)
        if checkpoint is None:
            raise FileNotFoundError(
                f"resume=true but there is no complete checkpoint under {self.checkpoint_dir}; "
                "run without resume, or point run.output_dir at the run to continue"
            )
        state = self.trainer.load_checkpoint(checkpoint)
        print(f"resumed from {checkpoint} at step {state['step']}", flush=True)
        return state["step"], state["data_state"]["position"]

    def _refit(self, version: int) -> float:
        started = time.monotonic()
        self.trainer.refit(self.generation, version)
        return time.monotonic() - started

    def _step(self, step: int, producer: RolloutProducer) -> dict[str, float]:
        loss = self.config.loss
        started = time.monotonic()
        groups = self._wait_for_batch(step, producer)
        waited = time.monotonic() - started
        trajectories = [t for group in groups for t in group]
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = grpo_advantages(
            rewards,
            [t.group_id for t in trajectories],
            normalize_by_std=loss.normalize_advantages_by_std,
            eps=_ADVANTAGE_EPS,
        )
        started = time.monotonic()
        train_metrics = self.trainer.train_step(trajectories, advantages)
        trained = time.monotonic() - started
        refit_s = self._refit(step + 1)
        buffer_stats = wait_for(
            self.buffer.stats.remote(), timeout_s=_CALL_MARGIN_S, what="replay buffer stats"
        )
        producer.advance(step + 1, buffer_stats["evicted_stale"])
        results = [r for group in groups for r in producer.summaries.pop(group[0].group_id)]
        metrics = self._metrics(step, trajectories, results, train_metrics, producer)
        metrics.update(
            {
                "timing/wait_for_batch_s": waited,
                "timing/train_s": trained,
                "timing/refit_s": refit_s,
                "perf/train_tokens_per_s": sum(len(t.token_ids) for t in trajectories) / trained,
                "async/evicted_stale_total": float(buffer_stats["evicted_stale"]),
                "async/buffer_groups": float(buffer_stats["size"]),
            }
        )
        return metrics

    def _wait_for_batch(self, step: int, producer: RolloutProducer) -> list[list[Trajectory]]:
        deadline = time.monotonic() + self.config.grpo.batch_timeout_s
        needed = self.config.grpo.num_prompts_per_step
        while True:
            if producer.fatal is not None:
                raise producer.fatal
            slice_s = max(min(deadline - time.monotonic(), 5.0), 0.01)
            try:
                return wait_for(
                    self.buffer.get_batch.remote(needed, step, slice_s),
                    timeout_s=slice_s + _CALL_MARGIN_S,
                    what=f"the replay buffer's batch for step {step}",
                )
            except TimeoutError:
                if time.monotonic() >= deadline:
                    if producer.fatal is not None:
                        raise producer.fatal from None
                    raise

    @staticmethod
    def _metrics(
        step: int,
        trajectories: Sequence[Trajectory],
        results: Sequence[Mapping[str, Any]],
        train_metrics: Mapping[str, float],
        producer: RolloutProducer,
    ) -> dict[str, float]:
        ages = [step - t.weight_version for t in trajectories]
        generated = sum(t.num_generated_tokens for t in trajectories)
        stats = producer.stats
        group_seconds, stats.group_seconds = stats.group_seconds, []
        metrics: dict[str, float] = {f"train/{k}": v for k, v in train_metrics.items()}
        metrics.update({f"train/{k}": v for k, v in per_agent_metrics(results).items()})
        metrics.update(
            {
                "train/reward/mean": float(sum(t.reward for t in trajectories) / len(trajectories)),
                "rollout/episodes": float(len(trajectories)),
                "rollout/generated_tokens": float(generated),
                "rollout/failures_total": float(producer.failures.count),
                "rollout/retries_total": float(stats.retries),
                "rollout/dropped_groups_total": float(stats.dropped_groups),
                "rollout/group_s/mean": _mean(group_seconds),
                "async/weight_version": float(step + 1),
                "async/trajectory_age/mean": _mean(ages),
                "async/trajectory_age/max": float(max(ages)),
            }
        )
        return metrics


def _scalar_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """What per-agent metrics need of a result: its agent and its numeric/boolean fields."""
    kept = {k: v for k, v in result.items() if isinstance(v, bool | int | float)}
    kept["agent_ref"] = result["agent_ref"]
    return kept


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
