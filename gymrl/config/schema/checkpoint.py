"""`checkpoint.*`: how often the trainer saves and how many saves stay on disk."""

from __future__ import annotations

from pydantic import Field

from gymrl.config.schema.base import Strict


class CheckpointConfig(Strict):
    every_n_steps: int = Field(default=0, ge=0, description="Save every N steps; 0 = never.")
    keep_last: int = Field(default=2, gt=0, description="Checkpoints kept on disk.")
