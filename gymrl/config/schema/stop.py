"""`stop.*`: what SIGINT/SIGTERM do to the step in progress."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gymrl.config.schema.base import Strict


class StopConfig(Strict):
    """What SIGINT/SIGTERM do (Slurm sends SIGTERM before preempting a job); gymrl/run/stop.py."""

    step_in_progress: Literal["finish", "abandon"] = Field(
        default="finish",
        description="finish: complete the step a signal arrives in (within deadline_s), so its "
        "work is kept; abandon: stop at once, the step is lost.",
    )
    deadline_s: float = Field(
        default=120.0,
        gt=0,
        description="How long a step may take to finish after a signal before it is abandoned; "
        "keep it under the time Slurm leaves between SIGTERM and SIGKILL, minus a checkpoint.",
    )
    checkpoint: bool = Field(
        default=True,
        description="Save the last finished step when a signal stops the run (unless the newest "
        "checkpoint already holds it), so resume=true loses nothing.",
    )
