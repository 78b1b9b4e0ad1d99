"""One GRPO group as it travels from the rollout producer through the replay buffer to the
trainer and the metrics: its trajectories, what per-agent metrics need of each episode's result,
and how long it took, in one frozen object.

Frozen because it crosses threads (the producer's, the buffer actor's, the trainer's), and built
from copies: nothing the producer keeps writing is ever shared with the step that trains on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymrl.algo.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutGroup:
    """Every episode of one row that came back, with one weight version: the oldest of its
    trajectories'. `summaries[i]` is episode i's agent and numeric result fields
    (`scalar_fields`); `seconds` runs from submission to the group's outcome;
    `failed_episodes` is how many of the row's episodes failed after their retries. With split
    mode an episode's tail segments follow its trajectory (`Trajectory.segment`), so
    `episodes` (one trajectory per summary) can be fewer than `trajectories`. `row_position`
    is what a checkpoint records of a group not yet trained, so a resume draws its row again."""

    group_id: str
    trajectories: tuple[Trajectory, ...]
    summaries: tuple[Mapping[str, Any], ...]
    seconds: float
    failed_episodes: int = 0
    row_position: int | None = None  # where the producer drew the row (RowStream), if it did

    def __post_init__(self):
        if not self.trajectories:
            raise ValueError(
                f"group {self.group_id!r} is an empty group; a GRPO group holds at least one "
                "rollout"
            )
        other = {t.group_id for t in self.trajectories} - {self.group_id}
        if other:
            raise ValueError(
                f"group {self.group_id!r} holds trajectories of several groups "
                f"{sorted(other | {self.group_id})}; build one group (trajectories sharing a "
                "group_id) at a time"
            )
        if len(self.summaries) != len(self.episodes):
            raise ValueError(
                f"group {self.group_id!r} has {len(self.summaries)} summaries for "
                f"{len(self.episodes)} trajectories; one per episode"
            )
        if self.trajectories[0].segment:
            raise ValueError(
                f"group {self.group_id!r} starts with a tail segment; a segment follows its "
                "episode's trajectory"
            )

    @classmethod
    def of(
        cls,
        trajectories: Sequence[Trajectory],
        summaries: Sequence[Mapping[str, Any]],
        *,
        seconds: float,
        failed_episodes: int = 0,
        row_position: int | None = None,
    ) -> RolloutGroup:
        group_id = trajectories[0].group_id if trajectories else "<empty>"
        return cls(
            group_id,
            tuple(trajectories),
            tuple(dict(s) for s in summaries),
            seconds,
            failed_episodes,
            row_position,
        )

    @property
    def episodes(self) -> tuple[Trajectory, ...]:
        """Each episode's own trajectory (its tail segments left out), in summary order."""
        return tuple(t for t in self.trajectories if not t.segment)

    @property
    def weight_version(self) -> int:
        return min(t.weight_version for t in self.trajectories)


def scalar_fields(result: Mapping[str, Any]) -> dict[str, Any]:
    """What per-agent metrics need of a result: its agent and its numeric/boolean fields."""
    kept = {k: v for k, v in result.items() if isinstance(v, bool | int | float)}
    kept["agent_ref"] = result["agent_ref"]
    return kept
