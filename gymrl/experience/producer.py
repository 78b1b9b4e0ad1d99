"""The rollout producer: keeps Gym shards busy within a credit limit and hands completed GRPO
groups to the replay buffer, from a thread of the recipe's process.

Credits: once the trainer has taken `step` steps, the buffer may have received
`(step + 1 + lookahead) * prompts_per_step` groups, where the lookahead is
`grpo.max_trajectory_age_steps` in async mode and 0 in sync mode; groups the buffer evicts as too
old were never trained on, so their credit comes back. The producer talks to two seams,
`GroupRunner` (Gym shards on Ray in a run) and `GroupSink` (the replay buffer), so its accounting
is tested without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gymrl.algo.episode_rules import EpisodeRules
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.experience.ledger import untrained_episodes
from gymrl.experience.rollout_group import RolloutGroup, scalar_fields
from gymrl.experience.rows import RowStream
from gymrl.run.progress import progressed, waiting
from nemo_gym_ext.config_errors import ConfigError, ConfigIssue
from nemo_gym_ext.postprocess import DECLARED, PostprocessedEpisode, row_id_of
from nemo_gym_ext.rollout import FailureBudget, GroupOutcome, UnknownAgentError
from nemo_gym_ext.wire import agent_name_of

_POLL_S = 0.5
log = logging.getLogger(__name__)
# Fields the producer adds to each episode's summary, so that per-agent metrics report them.
LENGTH_PENALTY_FIELD = "length_penalty"
OVERLONG_MASKED_FIELD = "overlong_masked"


class EveryPromptRefusedError(ValueError):
    """The policy server refused every row's prompt as longer than its context."""


# ---------------------------------------------------------------------------------------------
# What the producer talks to: runners of groups and a buffer (gymrl.roles on Ray in a run)
# ---------------------------------------------------------------------------------------------


class GroupRunner(Protocol):
    """Runs GRPO groups somewhere (Gym shards on Ray in a run) and says when they finish.

    A running group is an opaque handle; the producer only submits, waits, reads and cancels.
    """

    @property
    def agents(self) -> Collection[str]:
        """The agents whose rows this runner serves."""
        ...

    def submit(self, agent: str, row: dict[str, Any], num_episodes: int) -> Any:
        """Start one group of `num_episodes` episodes of `row`; returns its handle."""
        ...

    def finished(self, running: Sequence[Any], timeout_s: float) -> list[Any]:
        """The handles of `running` that are done, waiting up to `timeout_s` for the first."""
        ...

    def outcome(self, group: Any) -> GroupOutcome:
        """A finished group's outcome; raises the error that ended it."""
        ...

    def cancel(self, group: Any) -> None: ...


class RouteSource(Protocol):
    """Router replay: where a collected episode's routed experts come from (the policy server's
    store, `gymrl.roles.generation_server.GenerationRole.attach_routes`)."""

    def attach_routes(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """`trajectories` in order, each with its `routed_experts` (masked ones as they are)."""
        ...


class GroupSink(Protocol):
    """Where completed groups go (the replay buffer); `put` returns whether it was stored."""

    def put(self, group: RolloutGroup, timeout_s: float) -> bool: ...

    def held_positions(self) -> list[int]:
        """The row positions of the groups it holds (stored, not yet served)."""
        ...


@dataclass(frozen=True)
class DataState:
    """Where a run is in its rows, as a checkpoint records it: the next new `position`, and the
    positions before it drawn but not yet trained (`pending`: in flight, or in the buffer),
    which a resume draws again first, once each."""

    position: int
    pending: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"position": self.position, "pending": list(self.pending)}


# ---------------------------------------------------------------------------------------------
# The rollout producer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerCounts:
    """Totals since the producer started: retried episodes, groups dropped for want of a
    baseline, episodes that failed after their retries, rows whose prompt the policy server
    refused as longer than its context, episode attempts that ran out of their deadline; with
    dynamic sampling, groups dropped
    for teaching nothing (per agent) and such groups delivered because the step's budget of
    drops was spent; the generated tokens of the groups it dropped, by (agent, ledger cause)
    (`gymrl.experience.ledger`)."""

    retries: int
    dropped_groups: int
    failures: int
    uniform_dropped: Mapping[str, int] = field(default_factory=dict)
    uniform_over_budget: int = 0
    untrained_tokens: Mapping[tuple[str, str], int] = field(default_factory=dict)
    prompts_too_long: int = 0
    episode_timeouts: int = 0


class RolloutProducer(threading.Thread):
    """Submits rows to a group runner within a credit limit and puts completed groups in a sink.

    Credits: the trainer allows groups up to `(step + 1 + lookahead) * prompts_per_step`, so the
    producer never runs further ahead than the trajectory-age bound makes useful. A group whose
    baseline would hold fewer than two entries (its episodes, plus its failed ones where the
    agent's `failed_reward` counts them) is dropped and does not use a credit;
    a group the buffer evicts as stale did use one, and the trainer gives it back in `advance`.
    """

    def __init__(
        self,
        grpo: GRPOConfig,
        rows: RowStream,
        runner: GroupRunner,
        buffer: GroupSink,
        *,
        first_step: int,
        failures: FailureBudget,
        rules: EpisodeRules,
        group_deadline_s: float,
        routes: RouteSource | None = None,
    ):
        """`group_deadline_s`: how long one group may take (every attempt of its episodes at
        their deadline): what the no-progress watchdog reports as the deadline of the wait for
        groups in flight. `routes`: with router replay, where each trajectory's routed experts
        are collected from as its group arrives."""
        super().__init__(name="rollout-producer", daemon=True)
        self._grpo = grpo
        self._group_deadline_s = group_deadline_s
        self._rules = rules
        self._rows = rows
        self._runner = runner
        self._buffer = buffer
        self._routes = routes
        self._lookahead = grpo.max_trajectory_age_steps if grpo.async_enabled else 0
        self._condition = threading.Condition()
        self._first_step = first_step
        self._weight_version = first_step
        self._allowed = self._credit(first_step)
        self._accepted = 0
        self._stopping = threading.Event()
        self.fatal: BaseException | None = None
        # Written by the producer thread, read by the trainer's: only under `_counts_lock`.
        self._counts_lock = threading.Lock()
        self._retries = self._dropped_groups = self._timeouts = 0
        self._failures = failures
        self._uniform_dropped: Counter[str] = Counter()
        self._uniform_over_budget = 0
        self._uniform_dropped_this_step = 0
        self._untrained_tokens: Counter[tuple[str, str]] = Counter()
        self._serial = 0
        # Indices in the data of rows whose prompt the policy server refused: never drawn again.
        self._refused_rows: set[int] = set()
        # Positions drawn whose group is neither delivered to the buffer nor dropped yet.
        self._pending: set[int] = set()

    def counts(self) -> ProducerCounts:
        """A consistent snapshot of the producer's totals, from any thread."""
        with self._counts_lock:
            return ProducerCounts(
                self._retries,
                self._dropped_groups,
                self._failures.count,
                dict(self._uniform_dropped),
                self._uniform_over_budget,
                dict(self._untrained_tokens),
                len(self._refused_rows),
                self._timeouts,
            )

    def data_state(self) -> DataState:
        """Where the run is in its rows now: the rows drawn so far, less those whose group was
        trained or dropped. The producer's own view is taken first, then the buffer's: a group
        delivered in between was still pending in the first, so none is missed."""
        with self._counts_lock:
            position = self._rows.position
            pending = self._pending | set(self._rows.queued())
        pending |= set(self._buffer.held_positions())
        return DataState(position, tuple(sorted(p for p in pending if p < position)))

    def _credit(self, step: int) -> int:
        """Groups the buffer may have received once the trainer has taken `step` steps."""
        steps_allowed = step - self._first_step + 1 + self._lookahead
        return steps_allowed * self._grpo.num_prompts_per_step

    def advance(self, step: int, evicted_total: int) -> None:
        """The trainer finished `step` steps and refit the engine: version `step` is live.
        Evicted groups were never trained on, so they are replaced."""
        with self._condition:
            self._weight_version = step
            self._allowed = self._credit(step) + evicted_total
            self._condition.notify_all()
        with self._counts_lock:
            self._uniform_dropped_this_step = 0  # the over-sampling budget is per step

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop submitting, cancel the groups in flight, and wait for the thread to end."""
        self._stopping.set()
        with self._condition:
            self._condition.notify_all()
        if self.is_alive():
            self.join(timeout_s)

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as error:  # handed to the trainer's thread, which raises it
            self.fatal = error

    def _produce(self) -> None:
        in_flight: dict[Any, tuple[str, int, float, int]] = {}
        try:
            self._submit_and_collect(in_flight)
        finally:
            for group in in_flight:
                self._runner.cancel(group)

    def _draw(self) -> tuple[int, dict[str, Any]]:
        """The next row whose prompt the policy server has not refused."""
        for _ in range(len(self._rows)):
            with self._counts_lock:  # drawn and pending at once, for `data_state`
                position, row = self._rows.next()
                if self._rows.index_of(position) not in self._refused_rows:
                    self._pending.add(position)
                    return position, row
        raise EveryPromptRefusedError(
            f"the policy server refused the prompt of every one of the {len(self._rows)} rows "
            "as longer than its context (the log names each); shorten the prompts or raise "
            "policy.max_total_sequence_length"
        )

    def _submit_and_collect(self, in_flight: dict[Any, tuple[str, int, float, int]]) -> None:
        size = self._grpo.num_generations_per_prompt
        agents = self._runner.agents
        idle_since: float | None = None  # since when no group is in flight and none may start
        while not self._stopping.is_set():
            with self._condition:
                room = self._allowed - self._accepted - len(in_flight)
                version = self._weight_version
            for _ in range(max(room, 0)):
                position, row = self._draw()
                agent = agent_name_of(row)
                if agent not in agents:
                    raise UnknownAgentError(
                        f"row {position} ({row_id_of(row)!r}) names agent {agent!r}, which no "
                        f"shard serves (served: {sorted(agents)}); fix the row's "
                        "agent_ref.name or env.nemo_gym.agents"
                    )
                self._serial += 1
                group_id = f"{row_id_of(row)}#{self._serial}"
                in_flight[self._runner.submit(agent, row, size)] = (
                    group_id,
                    version,
                    time.monotonic(),
                    position,
                )
            if not in_flight:
                idle_since = idle_since or time.monotonic()
                with (
                    waiting(
                        "the trainer to take a step (no credit left)",
                        self._grpo.batch_timeout_s,
                        since=idle_since,
                    ),
                    self._condition,
                ):
                    self._condition.wait(_POLL_S)
                continue
            idle_since = None
            oldest_id, _, oldest, _ = min(in_flight.values(), key=lambda entry: entry[2])
            with waiting(
                f"{len(in_flight)} group(s) in flight, the oldest {oldest_id}",
                self._group_deadline_s,
                since=oldest,
            ):
                finished = self._runner.finished(list(in_flight), _POLL_S)
            for group in finished:
                group_id, version, started, position = in_flight.pop(group)
                # Contiguity and malformed-result errors propagate from here.
                outcome = self._runner.outcome(group)
                if outcome.prompt_refused:
                    self._refuse(outcome, position)
                else:
                    self._accept(outcome, group_id, version, time.monotonic() - started, position)
                with self._counts_lock:  # delivered (the buffer holds it) or dropped
                    self._pending.discard(position)

    def _refuse(self, outcome: GroupOutcome, position: int) -> None:
        """The policy server refused the row's prompt: say so, count it, never draw it again.
        Not a failure of the run's machinery, so not counted against the failure budget; the
        group uses no credit, so another row takes its place."""
        with self._counts_lock:
            self._refused_rows.add(self._rows.index_of(position))
        log.warning(f"skipping row {position} for the rest of the run: {outcome.prompt_refused}")

    def _accept(
        self, outcome: GroupOutcome, group_id: str, version: int, seconds: float, position: int
    ) -> None:
        # A baseline needs two entries: the episodes, and the failed ones where the agent's
        # failed_reward counts them (so a lone survivor keeps its group); without, another
        # row replaces the group.
        rules = self._rules.loss.episode_rules(outcome.agent)
        failed = len(outcome.failures) if rules.failed_reward is not None else 0
        baseline = bool(outcome.episodes) and len(outcome.episodes) + failed >= 2
        results = [episode.full_result for episode in outcome.episodes]
        agents = [outcome.agent] * len(results)
        with self._counts_lock:
            self._retries += outcome.retries
            self._timeouts += outcome.timeouts
            self._dropped_groups += not baseline
            if not baseline:
                lost = untrained_episodes(agents, results, "failed_or_masked")
                self._untrained_tokens.update(lost)
            # Past the budget: raises, ends the thread.
            self._failures.record(
                outcome.failures, episodes=len(outcome.episodes) + len(outcome.failures)
            )
        if not baseline:
            return
        self._check_declared_segments(outcome.agent, outcome.episodes)
        heads = [
            self._rules.shape(
                Trajectory.from_postprocessed(episode, group_id=group_id, weight_version=version)
            )
            for episode in outcome.episodes
        ]
        trajectories = []  # each episode's trajectory, then its tail segments (split mode)
        for episode, head in zip(outcome.episodes, heads, strict=True):
            trajectories.append(head)
            trajectories += [
                self._rules.shape(segment)
                for segment in Trajectory.segments_from_postprocessed(
                    episode, group_id=group_id, weight_version=version
                )
            ]
        if self._routes is not None:  # taken even if dropped below: the store frees them
            trajectories = self._routes.attach_routes(trajectories)
        if self._drops_as_uniform(trajectories, len(outcome.failures)):
            with self._counts_lock:
                self._untrained_tokens.update(untrained_episodes(agents, results, "no_variance"))
            return
        group = RolloutGroup.of(
            trajectories,
            [
                {
                    **scalar_fields(episode.full_result),
                    LENGTH_PENALTY_FIELD: trajectory.length_penalty,
                    OVERLONG_MASKED_FIELD: trajectory.overlong and trajectory.is_masked,
                }
                for episode, trajectory in zip(outcome.episodes, heads, strict=True)
            ],
            seconds=seconds,
            failed_episodes=len(outcome.failures),
            row_position=position,
        )
        # A group the buffer finds already stale counts as delivered: the trainer's eviction
        # count, passed to `advance`, is what gives its credit back.
        self._buffer.put(group, self._grpo.batch_timeout_s)
        # Progress is a group that can train: one dropped (every episode failed, no baseline,
        # no variance) came back all the same, and a run of nothing else must trip the watchdog.
        progressed(f"group {group_id} reached the replay buffer")
        with self._condition:
            self._accepted += 1

    def _check_declared_segments(
        self, agent: str, episodes: Sequence[PostprocessedEpisode]
    ) -> None:
        """Refuse, by the loss's keys, an episode trained as declared compaction segments under
        a loss that weighs each sequence whole. Split mode's tails are refused at composition
        (`gymrl.preflight.rules.env`); whether an agent compacts is known only from its results,
        since a remote agent's config is not the recipe's to read."""
        choices = self._rules.loss.whole_sequence_choices()
        if not choices or not any(DECLARED in episode.segment_kinds for episode in episodes):
            return
        raise ConfigError(
            [
                ConfigIssue(
                    key,
                    value,
                    f"agent {agent!r} declares context compactions, whose segments are trained "
                    "as sequences of their own, so this would weigh (or judge) a compacted "
                    "episode once per segment",
                    fix,
                )
                for key, (value, fix) in choices.items()
            ]
        )

    def _drops_as_uniform(self, group: Sequence[Trajectory], failed: int) -> bool:
        """Dynamic sampling: whether to drop this group, which teaches nothing, within the
        step's budget of drops (counted either way)."""
        sampling = self._grpo.dynamic_sampling
        if not sampling.enabled or not self._rules.teaches_nothing(group, failed):
            return False
        with self._counts_lock:
            if self._uniform_dropped_this_step >= sampling.max_dropped_groups_per_step:
                self._uniform_over_budget += 1
                return False
            self._uniform_dropped_this_step += 1
            self._uniform_dropped[group[0].agent] += 1
            return True
