"""The narrow interface of a policy trainer (torch on CPU/small GPUs, Megatron-core on clusters).

The training loop hands a trainer one step's trajectories with their GRPO advantages; the trainer
returns scalar metrics. After each step the loop refits the generation engines: the torch trainer
exports its weights (`export_weights`), the Megatron trainer pushes them to SGLang itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from gymrl.algo.trajectory import Trajectory


class PolicyTrainer(Protocol):
    def train_step(
        self, trajectories: Sequence[Trajectory], advantages: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step over `trajectories` (advantages aligned with them)."""
        ...

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """Full weights, named as the generation engine's model names them."""
        ...

    def save_checkpoint(
        self, directory: Path, step: int, data_state: Mapping[str, Any]
    ) -> Path: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore weights and optimizer; return the trainer state (step, data_state, ...)."""
        ...
