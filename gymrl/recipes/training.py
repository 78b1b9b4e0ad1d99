"""The async GRPO recipe: setup, train, cleanup; the rollout producer (gymrl/experience/producer.py)
feeds a replay buffer that the training steps drain.

    producer thread ──run_group──▶ GymShard actors ──/run──▶ agents ──/chat/completions──▶
    GenerationServer;  completed groups ──put──▶ ReplayBuffer ──get_batch──▶ trainer step
    ──export_weights──▶ GenerationServer.update_weights (version = step count)

Async (`grpo.async_enabled`): the producer may run `max_trajectory_age_steps` steps ahead of the
trainer, so generation overlaps training; the buffer evicts groups older than that bound. Sync:
the producer makes exactly one step's groups, then waits for the trainer and the refit.

Nothing waits without a deadline: the trainer's wait for a batch is bounded by
`grpo.batch_timeout_s`; every episode by `env.rollout.run_timeout_s`. A failed episode is retried
`env.rollout.max_retries` times, then counted against `env.rollout.failure_budget` and
`env.rollout.failure_rate` (not with `env.rollout.on_episode_error=reward`); past them, or on a
contiguity/malformed-result error (never retried), the run stops with the cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from gymrl.algo.episode_rules import EpisodeRules
from gymrl.cluster.ray_calls import wait_for
from gymrl.cluster.session import ClusterSession
from gymrl.config.schema.recipe import RecipeConfig
from gymrl.experience.held_out import HeldOutEpisode, Validator
from gymrl.experience.ledger import TokenLedger
from gymrl.experience.producer import DataState, RolloutProducer
from gymrl.experience.rollout_group import RolloutGroup
from gymrl.experience.rows import RowStream, load_rows, load_validation_rows
from gymrl.generation.server.announce import announce_policy_server
from gymrl.generation.server.api_key import resolve_api_key
from gymrl.generation.server.route_store import RouteStoreCounts
from gymrl.generation.server.sampling_rules import training_sampling_rules
from gymrl.model.policy import model_folder
from gymrl.recipes.step_metrics import (
    EngineSnapshot,
    engine_metrics,
    router_replay_metrics,
    step_metrics,
)
from gymrl.roles.generation_server import ROUTE_ASSEMBLY_S, start_generation_server
from gymrl.roles.gym_shard import RayGroupRunner, start_gym_shards
from gymrl.roles.replay_buffer_actor import start_replay_buffer
from gymrl.roles.trainer import start_trainer
from gymrl.run.checkpoint import latest_verified_checkpoint
from gymrl.run.folder import (
    METRICS_FILENAME,
    TRAINED_ROWS_FILENAME,
    RunIdentity,
    append_trained_rows,
    claim_run_folder,
)
from gymrl.run.progress import ProgressWatch, progressed, waiting
from gymrl.run.stop import StopSignals
from gymrl.tracking.metrics_logger import build_logger
from gymrl.tracking.plot import plot_run
from gymrl.tracking.records import read_records
from gymrl.trainer.parity_gate import PASSED_METRIC, first_step_check
from nemo_gym_ext.gym_launch import gym_launcher
from nemo_gym_ext.rollout import FailureBudget

log = logging.getLogger(__name__)


class GRPORecipe:
    """One training run in the order it happens: `setup()`, `train()`, `cleanup()`.

    `setup` starts the cluster session (Ray and the placement, gymrl.cluster.session), then each
    role (trainer, generation server, Gym shards, replay buffer), resumes from a checkpoint,
    refits the engine to the trainer's weights and starts the rollout producer; everything is put
    on the session's stack of closers the moment it exists. `cleanup` closes that stack in
    reverse order (the watchdog, the producer, the logger, the buffer, the shards' agents before
    the policy server they call, the generation server, the trainer, the placement group, Ray),
    so it undoes exactly what a setup got through, also one that failed half-way. Call it in a
    `finally`.

    Where it lives: torchtune keeps its recipe classes in recipes/*.py. Here the class lives in
    the package and recipes/grpo.py drives its three verbs, because the same entry point serves
    dry runs, which must import neither torch nor Ray (one deferred import keeps them out), and
    because tests import the recipe by module name (recipes/ is not a package).
    """

    def __init__(self, config: RecipeConfig, output_dir: Path):
        self.config = config
        self.output_dir = output_dir
        self.checkpoint_dir = output_dir / "checkpoints"
        self.cluster = ClusterSession()
        # Installed by the entry point (`install_stop_signals`); tests drive the recipe without.
        self.stops = StopSignals(config.stop.step_in_progress, config.stop.deadline_s)
        self._stops_installed = False
        # What a checkpoint on stop would hold: the last finished (trained, refitted, logged)
        # step and where the run was in its rows at its end; and the newest step on disk. While
        # `_trainer_ahead` the trainer's state is past `finished_step` (an optimizer step or a
        # save is under way), so it cannot be saved as that step.
        self.finished_step = self.saved_step = 0
        self._finished_data = self._step_end_data = DataState(0)
        self._trainer_ahead = False
        # The rows (position, id) of the step under way, for trained_rows.jsonl.
        self._step_rows: list[tuple[int | None, str]] = []
        # Generated tokens accounted since the last record, trained or not (`ledger/...`).
        self.ledger = TokenLedger()

    def install_stop_signals(self) -> None:
        """SIGINT/SIGTERM stop the run cleanly (gymrl/run/stop.py); main thread only."""
        self.stops.install()
        self._stops_installed = True

    # --------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Start the run, one step after the other; on failure, what started so far is on the
        cluster session's stack for `cleanup`."""
        config = self.config
        # First: a bad key source must fail before anything starts.
        api_key = resolve_api_key(config.generation.server.api_key_file)
        started = time.monotonic()
        identity = self._claim_run_folder()
        cluster = self.cluster
        cluster.start(config, install_signals=self.stops.install if self._stops_installed else None)
        shards_by_agent = self._start_roles(api_key, started)
        rows = self._load_rows(shards_by_agent)
        self.buffer = start_replay_buffer(
            config.grpo,
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        data = self._resume_and_refit()
        self.rows = RowStream(rows, data.position, seed=config.run.seed, redraw=data.pending)
        runner = RayGroupRunner(shards_by_agent, self.generation.raise_if_engine_failed)
        self.validator = self._validator(rows, runner)
        self._start_logger(identity)
        self._start_producer(runner)
        self._start_watchdog()

    def _claim_run_folder(self) -> RunIdentity:
        """The run folder's identity; a missing Gym venv or a folder another run holds fails
        here, before anything starts."""
        config = self.config
        if config.env.source == "gym_launch":
            gym_launcher(Path(config.env.gym.venv))
        return claim_run_folder(self.output_dir, resume=config.resume)

    def _start_roles(self, api_key: SecretStr, started: float) -> dict[str, Any]:
        """The trainer, the generation server (announced) and the Gym shards; the shard actor
        serving each agent.

        Every role has its bundles in the placement group already, so the order of starting is
        free: the trainer is launched first and waited for last, so that its model loads while
        the generation server and the Gym shards start (6 s of the embedded run's setup on 2
        cores)."""
        config, cluster = self.config, self.cluster
        # Async on a CPU: generation and training overlap, one core each; sync: they alternate.
        threads = 1 if config.grpo.async_enabled else 2
        folder = model_folder(config.policy)  # converts the embedded model once, here
        self.trainer = start_trainer(
            config,
            self.output_dir,
            torch_threads=threads,
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        self._start_generation_server(api_key, threads, started)
        shards_by_agent = start_gym_shards(
            config,
            output_dir=self.output_dir,
            policy=self.generation.policy,
            model_folder=folder,
            placement=cluster.placement,
            group=cluster.group,
            on_cleanup=cluster.on_cleanup,
        )
        self.trainer.wait_until_started()
        log.info(
            f"{len(config.gym_shards)} Gym shard(s) up, {time.monotonic() - started:.1f} s into "
            f"setup ({config.env.source}), serving {sorted(shards_by_agent)}"
        )
        return shards_by_agent

    def _start_generation_server(self, api_key: SecretStr, threads: int, started: float) -> None:
        """The generation server with the run's sampling rules, announced to Gym deployments
        started by hand (`policy_server.json`)."""
        config, cluster = self.config, self.cluster
        self.generation = start_generation_server(
            config,
            output_dir=self.output_dir,
            torch_threads=threads,
            placement=cluster.placement,
            group=cluster.group,
            api_key=api_key,
            on_cleanup=cluster.on_cleanup,
            episode_deadline_s=config.env.rollout.run_timeout_s,
            sampling_rules=training_sampling_rules(config),
        )
        log.info(f"policy server up {time.monotonic() - started:.1f} s into setup")
        announce_policy_server(self.output_dir, self.generation.policy)

    def _load_rows(self, shards_by_agent: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The training rows; every row's agent is served, checked before any episode runs."""
        config = self.config
        return load_rows(
            config.env.data,
            config.gym_shards,
            config.generation.sampling,
            config.run.seed,
            served_agents=shards_by_agent,
            max_output_tokens=config.generation.server.max_tokens_per_turn,
        )

    def _resume_and_refit(self) -> DataState:
        """Load the checkpoint to resume from (if any), refit the engine to the trainer's
        weights, and return where in the rows the run goes on."""
        self.first_step, data = self._resume()
        self.finished_step = self.saved_step = self.first_step
        self._finished_data = data
        self._refit(self.first_step)
        return data

    def _validator(self, rows: list[dict[str, Any]], runner: RayGroupRunner) -> Validator | None:
        """The held-out pass, built whenever a `grpo.val_*` setting asks for one."""
        config, grpo = self.config, self.config.grpo
        if not (grpo.val_at_start or grpo.val_period or grpo.val_at_end):
            return None
        held_out = load_validation_rows(
            config.env.data,
            config.gym_shards,
            rows,
            temperature=grpo.val_temperature,
            top_p=config.generation.sampling.top_p,
            served_agents=runner.agents,
        )
        return Validator(
            held_out,
            runner,
            grpo.batch_timeout_s,
            max_refused_share=config.env.data.max_refused_held_out_share,
        )

    def _start_logger(self, identity: RunIdentity) -> None:
        """The metrics logger, under the folder's W&B run id, which a resume continues."""
        config = self.config
        self.logger = build_logger(
            config.logger,
            run_name=config.run.name,
            output_dir=self.output_dir,
            hparams=config.model_dump(mode="json"),
            total_steps=config.grpo.num_steps,
            first_step=self.first_step,
            run_id=identity.wandb_run_id,
        )
        self.cluster.on_cleanup("the metrics logger", self.logger.close)

    def _start_producer(self, runner: RayGroupRunner) -> None:
        """The rollout producer, started once the first step's engine window opens."""
        config = self.config
        self.episode_rules = EpisodeRules(config.loss, config.generation.server.max_tokens_per_turn)
        rollout = config.env.rollout
        self.producer = RolloutProducer(
            config.grpo,
            self.rows,
            runner,
            self.buffer,
            first_step=self.first_step,
            failures=FailureBudget(
                rollout.failure_budget,
                rate=rollout.failure_rate,
                charge=rollout.on_episode_error == "fail",
            ),
            rules=self.episode_rules,
            group_deadline_s=_group_deadline_s(config),
            routes=self.generation if config.policy.router_replay.enabled else None,
        )
        self._engine_seen = self._engine_snapshot()  # the first step's window starts here
        self.producer.start()
        self.cluster.on_cleanup("the rollout producer", self.producer.stop)

    def _start_watchdog(self) -> None:
        """The no-progress watchdog (`run.progress_timeout_s`), closed first: cleanup's own
        waits must not be cut short by a tripped watch."""
        timeout_s = self.config.run.progress_timeout_s
        if timeout_s is not None:
            watch = ProgressWatch(timeout_s)
            watch.start()
            self.cluster.on_cleanup("the no-progress watchdog", watch.stop)

    def _resume(self) -> tuple[int, DataState]:
        """The step and data state to start from: 0 and the first row, or a checkpoint's."""
        if not self.config.resume:
            return 0, DataState(0)
        checkpoint, rejected = latest_verified_checkpoint(self.checkpoint_dir)
        for problem in rejected:
            log.warning(f"skipping a damaged checkpoint: {problem}")
        if (
            checkpoint is None
            and not rejected
            and not (self.output_dir / TRAINED_ROWS_FILENAME).exists()
        ):
            # No step of this folder's run ever ended (a Slurm job stopped during its setup and
            # requeued with resume=true by launch/ray.sub): nothing was trained, nothing is lost.
            log.info("resume=true: no step of this run ever ended; starting at step 0")
            return 0, DataState(0)
        if checkpoint is None:
            raise FileNotFoundError(
                f"resume=true but there is no complete checkpoint under {self.checkpoint_dir} "
                f"whose files match their checksums ({len(rejected)} damaged); run without "
                "resume, or point run.output_dir at the run to continue"
            )
        state = self.trainer.load_checkpoint(checkpoint)
        log.info(f"resumed from {checkpoint} at step {state['step']}")
        data = state["data_state"]
        # Checkpoints of earlier versions hold no pending rows (they skipped them).
        return state["step"], DataState(data["position"], tuple(data.get("pending", ())))

    # --------------------------------------------------------------------------------- train
    def train(self) -> None:
        """Every step from the first (0, or the resumed one) to `grpo.num_steps`."""
        config = self.config
        every = config.checkpoint.every_n_steps
        if config.grpo.val_at_start and self.first_step == 0:
            self.logger.log(0, {**self._validate(), **self.ledger.take()})
        last = time.monotonic()
        for step in range(self.first_step, config.grpo.num_steps):
            with self.stops.step():
                metrics = self._step(step)
                if self._validates_after(step + 1):
                    metrics.update(self._validate())
                metrics.update(self.ledger.take())
                now = time.monotonic()
                metrics["timing/step_s"] = now - last
                last = now
                if every and (step + 1) % every == 0:
                    metrics["timing/checkpoint_s"] = self._save_checkpoint(
                        step + 1, self._step_end_data
                    )
                self.logger.log(step + 1, metrics)
                append_trained_rows(self.output_dir, step + 1, self._step_rows)
                self.finished_step, self._finished_data = step + 1, self._step_end_data
                self._trainer_ahead = False
                progressed(f"step {step + 1} ended")
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
        """One validation pass on the weights the engine has now (gymrl.experience.held_out)."""
        assert self.validator is not None  # built whenever a grpo.val_* setting asks for it
        started = time.monotonic()
        # The pass is the trainer loop's wait (its episodes are the progress), so the watchdog's
        # report names it rather than a busy loop.
        with waiting("a validation pass (grpo.batch_timeout_s)", self.config.grpo.batch_timeout_s):
            # Validation's sampling is allowed by the policy server during the pass only.
            self._set_validating(True)
            try:
                metrics = self.validator.run(on_episode=self._count_validation_tokens)
            finally:
                self._set_validating(False)
        metrics["timing/validation_s"] = time.monotonic() - started
        return metrics

    def _set_validating(self, validating: bool) -> None:
        wait_for(
            self.generation.actor.set_validating.remote(validating),
            timeout_s=self.config.grpo.batch_timeout_s,
            what="the policy server's validation window",
        )

    def _count_validation_tokens(self, episode: HeldOutEpisode) -> None:
        progressed("a validation episode came back")
        if episode.summary is not None:  # a failed episode has no result, so no token count
            self.ledger.validation_pass([episode.summary])

    def _save_checkpoint(self, step: int, data: DataState) -> float:
        """Save the trainer's state as `step` with the data state `data`; returns the seconds."""
        started = time.monotonic()
        self.trainer.save_checkpoint(self.checkpoint_dir, step, data.as_json())
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
        seconds = self._save_checkpoint(self.finished_step, self._finished_data)
        return f"saved a checkpoint of step {self.saved_step} in {seconds:.1f} s"

    def _refit(self, version: int) -> float:
        started = time.monotonic()
        self.trainer.refit(self.generation.actor, version)
        return time.monotonic() - started

    def _step(self, step: int) -> dict[str, float]:
        producer = self.producer
        started = time.monotonic()
        groups = self._wait_for_batch(step)
        waited = time.monotonic() - started
        # A group's id is "<row id>#<serial>" (gymrl.experience.producer).
        self._step_rows = [(g.row_position, g.group_id.rpartition("#")[0]) for g in groups]
        trajectories = [t for group in groups for t in group.trajectories]
        advantages = self.episode_rules.advantages(
            trajectories, {group.group_id: group.failed_episodes for group in groups}
        )
        started = time.monotonic()
        self._trainer_ahead = True
        parity = first_step_check(
            self.config.grpo.parity_gate,
            step=step,
            first_step=self.first_step,
            trajectories=trajectories,
            compute_dtype=self.trainer.compute_dtype,
        )
        train_metrics = self.trainer.train_step(trajectories, advantages, parity)
        trained = time.monotonic() - started
        # The gate's verdict is its own key (parity/passed), not one of the trainer's.
        checked = {} if parity is None else {PASSED_METRIC: train_metrics.pop(PASSED_METRIC)}
        refit_s = self._refit(step + 1)
        buffer_stats = self.buffer.stats()
        # Before `advance` lets the producer take the next step's rows: in sync mode exactly the
        # rows trained so far; in async mode also the rows drawn for later steps and not yet
        # trained (in flight or in the buffer), which a resume draws again first.
        self._step_end_data = producer.data_state()
        producer.advance(step + 1, buffer_stats["evicted_stale"])
        counts = producer.counts()
        self.ledger.trained_groups(groups)
        self.ledger.running_totals("producer", counts.untrained_tokens)
        self.ledger.running_totals("buffer", self.buffer.evicted_tokens())
        metrics = step_metrics(
            step, groups, train_metrics, counts, self.config.generation.server.max_tokens_per_turn
        )
        metrics.update(self._engine_metrics())
        if self.config.policy.router_replay.enabled:
            metrics.update(router_replay_metrics(trajectories, self._route_counts()))
        metrics.update(checked)
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

    def _engine_snapshot(self) -> EngineSnapshot:
        counters, sampling, divergence = wait_for(
            [
                self.generation.actor.engine_counters.remote(),
                self.generation.actor.sampling_counts.remote(),
                self.generation.actor.divergence_counts.remote(),
            ],
            timeout_s=self.config.grpo.batch_timeout_s,
            what="the engine's counters",
        )
        assert sampling is not None, "a training run's policy server has sampling parity"
        return EngineSnapshot(time.monotonic(), counters, sampling, divergence)

    def _route_counts(self) -> RouteStoreCounts:
        return wait_for(
            self.generation.actor.route_counts.remote(),
            timeout_s=ROUTE_ASSEMBLY_S,
            what="the policy server's route store counts",
        )

    def _engine_metrics(self) -> dict[str, float]:
        """The engine's figures over the window since the last call (the step's), which the
        next step's window starts from."""
        seen, self._engine_seen = self._engine_seen, self._engine_snapshot()
        return engine_metrics(seen, self._engine_seen)

    def _wait_for_batch(self, step: int) -> list[RolloutGroup]:
        """The step's groups, waiting in short slices so a producer error surfaces at once."""
        timeout_s = self.config.grpo.batch_timeout_s
        deadline = time.monotonic() + timeout_s
        needed = self.config.grpo.num_prompts_per_step
        with waiting(f"step {step}'s {needed} groups from the replay buffer", timeout_s):
            return self._take_batch(step, needed, deadline)

    def _take_batch(self, step: int, needed: int, deadline: float) -> list[RolloutGroup]:
        producer = self.producer
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

    # ------------------------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        """Close, in reverse order, whatever `setup` started; safe after a failed setup and
        when called twice. A role that does not close cleanly is reported, not raised: it must
        not mask the error that ended the run, nor keep the roles before it from closing."""
        self.cluster.close()


def _group_deadline_s(config: RecipeConfig) -> float:
    """The longest one group may take: every attempt of its episodes at its deadline, with the
    longest back-off between attempts (episodes run concurrently)."""
    rollout = config.env.rollout
    attempts = rollout.max_retries + 1
    return attempts * rollout.run_timeout_s + rollout.max_retries * rollout.retry_backoff_max_s
