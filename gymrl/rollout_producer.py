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

import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema import GRPOConfig
from gymrl.data import RowStream
from gymrl.ray_calls import wait_for
from gymrl.replay_buffer import Group
from nemo_gym_ext.postprocess import row_id_of
from nemo_gym_ext.rollout import FailureBudget, GroupOutcome, UnknownAgentError
from nemo_gym_ext.wire import agent_name_of

_POLL_S = 0.5
CALL_MARGIN_S = 60.0  # on top of a callee's own deadline: Ray scheduling and transfer


# ---------------------------------------------------------------------------------------------
# What the producer talks to: runners of groups and a buffer, on Ray in a run
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


class GroupSink(Protocol):
    """Where completed groups go (the replay buffer); `put` returns whether it was stored."""

    def put(self, group: Group, timeout_s: float) -> bool: ...


class RayGroupRunner:
    """Groups run as `GymShard.run_group` calls on the shard serving the row's agent."""

    def __init__(self, shards_by_agent: Mapping[str, Any]):
        self._shards = shards_by_agent

    @property
    def agents(self) -> Collection[str]:
        return self._shards.keys()

    def submit(self, agent: str, row: dict[str, Any], num_episodes: int) -> Any:
        return self._shards[agent].run_group.remote(row, num_episodes)

    def finished(self, running: Sequence[Any], timeout_s: float) -> list[Any]:
        done, _ = ray.wait(list(running), num_returns=1, timeout=timeout_s)
        return done

    def outcome(self, group: Any) -> GroupOutcome:
        return wait_for(group, timeout_s=_POLL_S, what="a finished group")

    def cancel(self, group: Any) -> None:
        ray.cancel(group)


class RemoteReplayBuffer:
    """The driver's handle on the replay buffer actor: every call waits with a deadline, on top
    of the buffer's own."""

    def __init__(self, actor: Any):
        self._actor = actor

    def put(self, group: Group, timeout_s: float) -> bool:
        return wait_for(
            self._actor.put.remote(group, timeout_s),
            timeout_s=timeout_s + CALL_MARGIN_S,
            what="putting a group into the replay buffer",
        )

    def get_batch(self, num_groups: int, step: int, timeout_s: float) -> list[Group]:
        return wait_for(
            self._actor.get_batch.remote(num_groups, step, timeout_s),
            timeout_s=timeout_s + CALL_MARGIN_S,
            what=f"the replay buffer's batch for step {step}",
        )

    def stats(self) -> dict[str, int]:
        return wait_for(self._actor.stats.remote(), timeout_s=CALL_MARGIN_S, what="buffer stats")


# ---------------------------------------------------------------------------------------------
# The rollout producer
# ---------------------------------------------------------------------------------------------


@dataclass
class _ProducerStats:
    retries: int = 0
    dropped_groups: int = 0
    group_seconds: list[float] = field(default_factory=list)


class RolloutProducer(threading.Thread):
    """Submits rows to a group runner within a credit limit and puts completed groups in a sink.

    Credits: the trainer allows groups up to `(step + 1 + lookahead) * prompts_per_step`, so the
    producer never runs further ahead than the trajectory-age bound makes useful. A group that
    comes back with fewer than two episodes (no baseline) is dropped and does not use a credit;
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
        failure_budget: int,
    ):
        super().__init__(name="rollout-producer", daemon=True)
        self._grpo = grpo
        self._rows = rows
        self._runner = runner
        self._buffer = buffer
        self._lookahead = grpo.max_trajectory_age_steps if grpo.async_enabled else 0
        self._condition = threading.Condition()
        self._first_step = first_step
        self._weight_version = first_step
        self._allowed = self._credit(first_step)
        self._accepted = 0
        self._stopping = threading.Event()
        self.fatal: BaseException | None = None
        self.stats = _ProducerStats()
        self.failures = FailureBudget(failure_budget)
        self.summaries: dict[str, list[dict[str, Any]]] = {}
        self._serial = 0

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
        in_flight: dict[Any, tuple[str, int, float]] = {}
        try:
            self._submit_and_collect(in_flight)
        finally:
            for group in in_flight:
                self._runner.cancel(group)

    def _submit_and_collect(self, in_flight: dict[Any, tuple[str, int, float]]) -> None:
        size = self._grpo.num_generations_per_prompt
        agents = self._runner.agents
        while not self._stopping.is_set():
            with self._condition:
                room = self._allowed - self._accepted - len(in_flight)
                version = self._weight_version
            for _ in range(max(room, 0)):
                position, row = self._rows.next()
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
                )
            if not in_flight:
                with self._condition:
                    self._condition.wait(_POLL_S)
                continue
            for group in self._runner.finished(list(in_flight), _POLL_S):
                group_id, version, started = in_flight.pop(group)
                # Contiguity and malformed-result errors propagate from here.
                outcome = self._runner.outcome(group)
                self.stats.group_seconds.append(time.monotonic() - started)
                self._accept(outcome, group_id, version)

    def _accept(self, outcome: GroupOutcome, group_id: str, version: int) -> None:
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
        self.summaries[group_id] = [scalar_fields(e["full_result"]) for e in outcome.episodes]
        # A group the buffer finds already stale counts as delivered: the trainer's eviction
        # count, passed to `advance`, is what gives its credit back.
        self._buffer.put(group, self._grpo.batch_timeout_s)
        with self._condition:
            self._accepted += 1


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


def scalar_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """What per-agent metrics need of a result: its agent and its numeric/boolean fields."""
    kept = {k: v for k, v in result.items() if isinstance(v, bool | int | float)}
    kept["agent_ref"] = result["agent_ref"]
    return kept
