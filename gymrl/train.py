"""The async GRPO recipe: setup, train, cleanup; the rollout producer (gymrl/rollout_producer.py)
feeds a replay buffer that the training steps drain.

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
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group

from gymrl.actors import GenerationServer, GymShard, GymShardLaunch, ReplayBufferActor, close_actor
from gymrl.algo.advantages import grpo_advantages, share_of_groups_with_variance
from gymrl.algo.trajectory import Trajectory
from gymrl.checkpoint import latest_verified_checkpoint
from gymrl.config.schema import ClusterConfig, RecipeConfig
from gymrl.config.validate import gym_actor_configs
from gymrl.data import RowStream, UnservedAgentError, load_rows, load_validation_rows
from gymrl.generation.announce import announce_policy_server
from gymrl.generation.api_key import ApiKeyError, resolve_api_key
from gymrl.metrics_logger import METRICS_FILENAME, build_logger
from gymrl.placement import actor_options, plan_placement, reserve
from gymrl.plot import plot_run, read_records
from gymrl.policy import tokenizer_folder
from gymrl.ray_calls import wait_for
from gymrl.replay_buffer import Group
from gymrl.roles import build_trainer_role
from gymrl.rollout_producer import (
    RayGroupRunner,
    RemoteReplayBuffer,
    RolloutProducer,
)
from gymrl.run_folder import RunFolderInUseError, claim_run_folder
from gymrl.stop import StopSignals
from gymrl.validation import Validator
from nemo_gym_ext.gym_launch import (
    GymStartError,
    GymVenvMissingError,
    PolicyEndpoint,
    gym_launcher,
    shard_port_range,
)
from nemo_gym_ext.metrics import per_agent_metrics
from nemo_gym_ext.postprocess import MalformedGymResultError, NonContiguousEpisodeError
from nemo_gym_ext.rollout import (
    RolloutBudgetExceeded,
    UnknownAgentError,
)

_SHARD_CLOSE_S = 30.0
_GENERATION_CLOSE_S = 60.0  # the server lets a running engine batch finish first
_ADVANTAGE_EPS = 1e-6


class ClusterUnavailableError(RuntimeError):
    """The configured Ray cluster cannot be reached."""


# Errors that end a run with a message a user can act on (printed without a traceback).
RUN_STOPPING_ERRORS = (
    ClusterUnavailableError,
    ApiKeyError,
    RunFolderInUseError,
    NonContiguousEpisodeError,
    MalformedGymResultError,
    UnknownAgentError,
    UnservedAgentError,
    RolloutBudgetExceeded,
    TimeoutError,
    # A role's process died (killed, out of memory, its node lost): the message names the actor.
    RayActorError,
    GymVenvMissingError,
    GymStartError,
)


def start_ray(cluster: ClusterConfig) -> None:
    """Join the configured Ray cluster, or start a local one (`cluster.ray_address` null).

    Ray's own default (`address=None`) would join a cluster it finds on this machine (one from
    `ray start`, or RAY_ADDRESS) and then refuse `num_cpus`; "local" always starts this run's own.
    """
    try:
        ray.init(
            address="local" if cluster.ray_address is None else cluster.ray_address,
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


def _start_timeout_s(config: RecipeConfig) -> float:
    """Deadline for the generation server: model loading, plus SGLang's own start deadline."""
    generation = config.generation
    engines = generation.server_start_timeout_s if generation.backend == "sglang" else 0.0
    return config.cluster.ray_start_timeout_s + engines


class GRPORecipe:
    """One training run in the order it happens: `setup()`, `train()`, `cleanup()`.

    `setup` starts Ray, then each role (generation server, trainer, Gym shards, replay buffer),
    resumes from a checkpoint, refits the engine to the trainer's weights and starts the rollout
    producer; every role is put on a stack of closers the moment it exists. `cleanup` closes
    that stack in reverse order (the producer, the logger, the buffer, the shards' agents before
    the policy server they call, the trainer, the generation server, Ray), so it undoes exactly
    what a setup got through, also one that failed half-way. Call it in a `finally`.

    Where it lives: torchtune keeps its recipe classes in recipes/*.py. Here the class lives in
    the package and recipes/grpo.py drives its three verbs, because the same entry point serves
    dry runs, which must import neither torch nor Ray (one deferred import keeps them out), and
    because tests import the recipe by module name (recipes/ is not a package).
    """

    def __init__(self, config: RecipeConfig, output_dir: Path):
        self.config = config
        self.output_dir = output_dir
        self.checkpoint_dir = output_dir / "checkpoints"
        self._closers = ExitStack()
        # Installed by the entry point (`install_stop_signals`); tests drive the recipe without.
        self.stops = StopSignals(config.stop.step_in_progress, config.stop.deadline_s)
        self._stops_installed = False
        # What a checkpoint on stop would hold: the last finished (trained, refitted, logged)
        # step and the row position at its end; and the newest step on disk. While
        # `_trainer_ahead` the trainer's state is past `finished_step` (an optimizer step or a
        # save is under way), so it cannot be saved as that step.
        self.finished_step = self.saved_step = 0
        self._finished_position = self._step_end_position = 0
        self._trainer_ahead = False

    def install_stop_signals(self) -> None:
        """SIGINT/SIGTERM stop the run cleanly (gymrl/stop.py); main thread only."""
        self.stops.install()
        self._stops_installed = True

    # --------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Start every role; on failure, what started so far is on the stack for `cleanup`."""
        config = self.config
        # First: a bad key source must fail before anything starts.
        self.policy_api_key = resolve_api_key(config.generation.server.api_key_file)
        started = time.monotonic()
        if config.env.source == "gym_launch":
            gym_launcher(Path(config.env.gym.venv))  # a missing venv fails before anything starts
        identity = claim_run_folder(self.output_dir, resume=config.resume)
        start_ray(config.cluster)
        self._on_cleanup("Ray", ray.shutdown)
        if self._stops_installed:
            self.stops.install()  # ray.init replaced the driver's SIGTERM handler
        # Async on a CPU: generation and training overlap, one core each; sync: they alternate.
        threads = 1 if config.grpo.async_enabled else 2
        folder = tokenizer_folder(config.policy)  # converts the embedded model once, here
        placement = plan_placement(config)
        group = reserve(placement, config.cluster.ray_start_timeout_s)
        if group is not None:
            self._on_cleanup("the placement group", lambda: remove_placement_group(group))
        # Generation first: SGLang engines pack onto whole nodes, the trainer takes the rest.
        self.generation = GenerationServer.options(
            **actor_options(placement.policy_server, 0, group)
        ).remote(
            config,
            output_dir=str(self.output_dir),
            torch_threads=threads,
            placement=placement,
            placement_group=group,
            api_key=self.policy_api_key,
        )
        self._on_cleanup(
            "the generation server",
            lambda: close_actor(self.generation, timeout_s=_GENERATION_CLOSE_S),
        )
        base_url = wait_for(
            self.generation.base_url.remote(),
            timeout_s=_start_timeout_s(config),
            what="starting the generation server",
        )
        print(f"policy server up {time.monotonic() - started:.1f} s into setup", flush=True)
        announce_policy_server(
            self.output_dir,
            base_url=base_url,
            model_name=config.policy.name,
            api_key=self.policy_api_key.get_secret_value(),
        )
        self.trainer = build_trainer_role(config, self.output_dir, threads, placement, group)
        self._on_cleanup("the trainer", self.trainer.close)
        self.actor_configs = gym_actor_configs(config)
        policy = PolicyEndpoint(
            base_url, self.policy_api_key.get_secret_value(), config.policy.name
        )
        shards_by_agent, shard_names = {}, {}
        for index, actor in enumerate(self.actor_configs):
            shard = GymShard.options(**actor_options(placement.gym_shards, 0, group)).remote(
                actor,
                config.env.rollout,
                policy=policy,
                tokenizer_folder=folder,
                launch=self._gym_launch(index, actor.shard),
            )
            self._on_cleanup(
                f"Gym shard {actor.shard!r}",
                lambda shard=shard: close_actor(shard, timeout_s=_SHARD_CLOSE_S),
            )
            launching = config.env.source == "gym_launch"
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
        print(
            f"{len(self.actor_configs)} Gym shard(s) up, {time.monotonic() - started:.1f} s into "
            f"setup ({config.env.source}), serving {sorted(shards_by_agent)}",
            flush=True,
        )
        # Every row's agent is served, checked before any episode runs.
        rows = load_rows(
            config.env.data,
            self.actor_configs,
            config.generation.sampling,
            config.run.seed,
            served_agents=shards_by_agent,
            max_output_tokens=config.generation.server.max_tokens_per_turn,
        )
        grpo = config.grpo
        capacity = (grpo.max_trajectory_age_steps + 2) * grpo.num_prompts_per_step
        buffer_actor = ReplayBufferActor.options(
            **actor_options(placement.buffer, 0, group)
        ).remote(grpo.max_trajectory_age_steps, capacity)
        self._on_cleanup("the replay buffer", lambda: close_actor(buffer_actor))
        self.buffer = RemoteReplayBuffer(buffer_actor)
        self.first_step, position = self._resume()
        self.finished_step = self.saved_step = self.first_step
        self._finished_position = position
        self._refit(self.first_step)
        self.rows = RowStream(rows, position)
        self.validator = (
            Validator(
                load_validation_rows(
                    config.env.data,
                    self.actor_configs,
                    rows,
                    temperature=grpo.val_temperature,
                    top_p=config.generation.sampling.top_p,
                ),
                RayGroupRunner(shards_by_agent),
                grpo.batch_timeout_s,
            )
            if grpo.val_at_start or grpo.val_period or grpo.val_at_end
            else None
        )
        self.logger = build_logger(
            config.logger,
            run_name=config.run.name,
            output_dir=self.output_dir,
            hparams=config.model_dump(mode="json"),
            total_steps=grpo.num_steps,
            first_step=self.first_step,
            run_id=identity.wandb_run_id,
        )
        self._on_cleanup("the metrics logger", self.logger.close)
        self.producer = RolloutProducer(
            grpo,
            self.rows,
            RayGroupRunner(shards_by_agent),
            self.buffer,
            first_step=self.first_step,
            failure_budget=config.env.rollout.failure_budget,
        )
        self.producer.start()
        self._on_cleanup("the rollout producer", self.producer.stop)

    def _gym_launch(self, index: int, shard: str) -> GymShardLaunch:
        """Shard `index`'s launch settings (used when env.source=gym_launch)."""
        gym = self.config.env.gym
        on_cluster = self.config.cluster.ray_address is not None
        return GymShardLaunch(
            venv=str(Path(gym.venv).resolve()),
            work_dir=str(self.output_dir / "gym" / shard),
            # On a cluster, agents on other nodes may call this shard's servers.
            host=ray.util.get_node_ip_address() if on_cluster else "127.0.0.1",
            port_range=shard_port_range(index, len(self.actor_configs), gym.port_range),
            start_timeout_s=gym.start_timeout_s,
        )

    def _on_cleanup(self, what: str, close: Callable[[], object]) -> None:
        self._closers.callback(_close_reporting_failure, what, close)

    def _resume(self) -> tuple[int, int]:
        """The step and row position to start from: 0, 0, or a checkpoint's."""
        if not self.config.resume:
            return 0, 0
        checkpoint, rejected = latest_verified_checkpoint(self.checkpoint_dir)
        for problem in rejected:
            print(f"warning: skipping a damaged checkpoint: {problem}", flush=True)
        if checkpoint is None:
            raise FileNotFoundError(
                f"resume=true but there is no complete checkpoint under {self.checkpoint_dir} "
                f"whose files match their checksums ({len(rejected)} damaged); run without "
                "resume, or point run.output_dir at the run to continue"
            )
        state = self.trainer.load_checkpoint(checkpoint)
        print(f"resumed from {checkpoint} at step {state['step']}", flush=True)
        return state["step"], state["data_state"]["position"]

    # --------------------------------------------------------------------------------- train
    def train(self) -> None:
        """Every step from the first (0, or the resumed one) to `grpo.num_steps`."""
        config = self.config
        every = config.checkpoint.every_n_steps
        if config.grpo.val_at_start and self.first_step == 0:
            self.logger.log(0, self._validate())
        last = time.monotonic()
        for step in range(self.first_step, config.grpo.num_steps):
            with self.stops.step():
                metrics = self._step(step)
                if self._validates_after(step + 1):
                    metrics.update(self._validate())
                now = time.monotonic()
                metrics["timing/step_s"] = now - last
                last = now
                if every and (step + 1) % every == 0:
                    metrics["timing/checkpoint_s"] = self._save_checkpoint(
                        step + 1, self._step_end_position
                    )
                self.logger.log(step + 1, metrics)
                self.finished_step, self._finished_position = step + 1, self._step_end_position
                self._trainer_ahead = False
            self.stops.step_finished()
        if config.logger.jsonl:
            metrics_path = self.output_dir / METRICS_FILENAME
            picture = plot_run(
                read_records(metrics_path), metrics_path.with_suffix(".png"), config.run.name
            )
            print(f"metrics: {metrics_path}\npicture: {picture}", flush=True)

    def _validates_after(self, steps_taken: int) -> bool:
        grpo = self.config.grpo
        periodic = grpo.val_period > 0 and steps_taken % grpo.val_period == 0
        return periodic or (grpo.val_at_end and steps_taken == grpo.num_steps)

    def _validate(self) -> dict[str, float]:
        """One validation pass on the weights the engine has now (see gymrl/validation.py)."""
        assert self.validator is not None  # built whenever a grpo.val_* setting asks for it
        started = time.monotonic()
        metrics = self.validator.run()
        metrics["timing/validation_s"] = time.monotonic() - started
        return metrics

    def _save_checkpoint(self, step: int, position: int) -> float:
        """Save the trainer's state as `step` with the row `position`; returns the seconds."""
        started = time.monotonic()
        self.trainer.save_checkpoint(self.checkpoint_dir, step, {"position": position})
        self.saved_step = step
        return time.monotonic() - started

    def checkpoint_on_stop(self) -> str:
        """After a stop signal: save the last finished step if `stop.checkpoint` asks for it and
        the newest checkpoint does not hold it; returns one sentence saying what was kept."""
        if not self.config.stop.checkpoint:
            return (
                "no checkpoint on stop (stop.checkpoint=false); last finished step "
                f"{self.finished_step}, newest checkpoint step {self.saved_step}"
            )
        if self.saved_step >= self.finished_step:
            return f"no step finished since the last checkpoint (step {self.saved_step})"
        if self._trainer_ahead:
            return (
                f"step {self.finished_step + 1} was abandoned inside the trainer, whose state is "
                f"no longer that of step {self.finished_step}; newest checkpoint: step "
                f"{self.saved_step}"
            )
        seconds = self._save_checkpoint(self.finished_step, self._finished_position)
        return f"saved a checkpoint of step {self.saved_step} in {seconds:.1f} s"

    def _refit(self, version: int) -> float:
        started = time.monotonic()
        self.trainer.refit(self.generation, version)
        return time.monotonic() - started

    def _step(self, step: int) -> dict[str, float]:
        loss, producer = self.config.loss, self.producer
        started = time.monotonic()
        groups = self._wait_for_batch(step)
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
        self._trainer_ahead = True
        train_metrics = self.trainer.train_step(trajectories, advantages)
        trained = time.monotonic() - started
        refit_s = self._refit(step + 1)
        buffer_stats = self.buffer.stats()
        # Before `advance` lets the producer take the next step's rows: in sync mode exactly the
        # rows trained so far, so a resume draws the same rows next (async: rows in flight for
        # later steps are past this position, and a resume skips them).
        self._step_end_position = self.rows.position
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

    def _wait_for_batch(self, step: int) -> list[Group]:
        """The step's groups, waiting in short slices so a producer error surfaces at once."""
        producer = self.producer
        deadline = time.monotonic() + self.config.grpo.batch_timeout_s
        needed = self.config.grpo.num_prompts_per_step
        while True:
            if producer.fatal is not None:
                raise producer.fatal
            slice_s = max(min(deadline - time.monotonic(), 5.0), 0.01)
            try:
                return self.buffer.get_batch(needed, step, slice_s)
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
                "train/groups_with_reward_variance": share_of_groups_with_variance(
                    [t.reward for t in trajectories], [t.group_id for t in trajectories]
                ),
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

    # ------------------------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        """Close, in reverse order, whatever `setup` started; safe after a failed setup and
        when called twice. A role that does not close cleanly is reported, not raised: it must
        not mask the error that ended the run, nor keep the roles before it from closing."""
        self._closers.close()


def _close_reporting_failure(what: str, close: Callable[[], object]) -> None:
    try:
        close()
    except Exception as error:
        print(f"warning: {what} did not close cleanly: {type(error).__name__}: {error}", flush=True)


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else math.nan
