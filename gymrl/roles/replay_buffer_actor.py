"""The replay buffer role: `gymrl.experience.replay_buffer.ReplayBuffer` as a threaded actor,
and the driver's handle on it, whose every call waits with a deadline on top of the buffer's own.
"""

from __future__ import annotations

from typing import Any

import ray

from gymrl.cluster.placement import Placement, actor_options
from gymrl.cluster.ray_calls import close_actor, wait_for
from gymrl.cluster.session import OnCleanup
from gymrl.config.schema.grpo import GRPOConfig
from gymrl.experience.replay_buffer import ReplayBuffer, RolloutGroup

CALL_MARGIN_S = 60.0  # on top of the buffer's own deadline: Ray scheduling and transfer

# A threaded actor (`put` and `get_batch` block): Ray's typed overload of remote(...) leaves out
# the actor-only max_concurrency.
ReplayBufferActor = ray.remote(num_cpus=0, max_concurrency=4)(ReplayBuffer)  # pyright: ignore[reportCallIssue]


class RemoteReplayBuffer:
    """The driver's handle on the replay buffer actor (the producer's `GroupSink`)."""

    def __init__(self, actor: Any):
        self._actor = actor

    def put(self, group: RolloutGroup, timeout_s: float) -> bool:
        return wait_for(
            self._actor.put.remote(group, timeout_s),
            timeout_s=timeout_s + CALL_MARGIN_S,
            what="putting a group into the replay buffer",
        )

    def get_batch(self, num_groups: int, step: int, timeout_s: float) -> list[RolloutGroup]:
        return wait_for(
            self._actor.get_batch.remote(num_groups, step, timeout_s),
            timeout_s=timeout_s + CALL_MARGIN_S,
            what=f"the replay buffer's batch for step {step}",
        )

    def stats(self) -> dict[str, int]:
        return wait_for(self._actor.stats.remote(), timeout_s=CALL_MARGIN_S, what="buffer stats")

    def held_positions(self) -> list[int]:
        return wait_for(
            self._actor.held_positions.remote(),
            timeout_s=CALL_MARGIN_S,
            what="the buffer's held row positions",
        )

    def evicted_tokens(self) -> dict[tuple[str, str], int]:
        return wait_for(
            self._actor.evicted_tokens.remote(),
            timeout_s=CALL_MARGIN_S,
            what="the buffer's evicted tokens",
        )


def start_replay_buffer(
    grpo: GRPOConfig, *, placement: Placement, group: Any, on_cleanup: OnCleanup
) -> RemoteReplayBuffer:
    """A buffer that holds the groups of the steps the age bound allows, plus two steps' room."""
    capacity = (grpo.max_trajectory_age_steps + 2) * grpo.num_prompts_per_step
    actor = ReplayBufferActor.options(**actor_options(placement.buffer, 0, group)).remote(
        grpo.max_trajectory_age_steps, capacity
    )
    on_cleanup("the replay buffer", lambda: close_actor(actor))
    return RemoteReplayBuffer(actor)
