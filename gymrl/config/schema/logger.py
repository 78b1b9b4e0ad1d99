"""`logger.*` (conf/logger/): W&B, metrics.jsonl and the console progress bar."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gymrl.config.schema.base import Strict


class WandbConfig(Strict):
    mode: Literal["offline", "online", "disabled"] = Field(
        default="offline",
        description="offline needs no account (sync later with `wandb sync`); online streams.",
    )
    project: str = Field(default="gym-grpo", description="W&B project.")
    entity: str | None = Field(default=None, description="W&B entity (team or user).")
    group: str | None = Field(
        default=None,
        description="W&B group. null = in a Hydra multirun, one group per sweep "
        "(<run.name>-<sweep folder>); a single run has none.",
    )
    job_type: str | None = Field(
        default=None, description="W&B job type. null = the experiment's name (+experiment=...)."
    )
    tags: list[str] | None = Field(
        default=None,
        description="W&B tags. null = the experiment's name and, in a sweep, key=value of each "
        "swept key.",
    )


class LoggerConfig(Strict):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    jsonl: bool = Field(default=True, description="Write <output_dir>/metrics.jsonl.")
    progress_bar: bool = Field(default=True, description="Console progress bar over steps.")
