"""Which checkpoint `eval.checkpoint` names, checked before any model loads, and its weights.

A user may name one checkpoint (`<run>/checkpoints/step_<n>`), a run's `checkpoints/` folder or a
run folder; the last two mean the newest checkpoint there that passes its manifest, found with
`gymrl.run.checkpoint.latest_verified_checkpoint`, the function a resume uses. A checkpoint named
directly must be complete and pass its manifest (`verify_checkpoint`); each refusal says which
and what to evaluate instead. Verification itself is `gymrl.run.checkpoint`'s alone. A LoRA
run's checkpoint holds its adapter (PEFT's format), which the engine merges into the policy's
base weights as a training refit does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gymrl.run.adapter import ADAPTER_CONFIG_FILE, AdapterWeights
from gymrl.run.checkpoint import (
    COMPLETE_MARKER,
    LEGACY_STATE_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    CorruptCheckpointError,
    TrainerState,
    latest_verified_checkpoint,
    verify_checkpoint,
)

_KEY = "eval.checkpoint"
_ONE_CHECKPOINT = re.compile(r"step_\d+")


class CheckpointRefusedError(ValueError):
    """`eval.checkpoint` names nothing that can be evaluated; the message says why and the fix."""


@dataclass(frozen=True)
class EvaluatedCheckpoint:
    """A verified checkpoint folder holding the torch trainer's weights (or a LoRA adapter),
    and its step."""

    folder: Path
    step: int

    @property
    def holds_adapter(self) -> bool:
        """A LoRA run's checkpoint: the adapter alone, for the policy's base weights."""
        return (self.folder / ADAPTER_CONFIG_FILE).is_file()

    @property
    def label(self) -> str:
        return f"step_{self.step}"


def choose_checkpoint(path: str) -> tuple[EvaluatedCheckpoint, list[str]]:
    """The checkpoint `eval.checkpoint=path` names, and one sentence per newer checkpoint that
    failed its manifest (when `path` is a folder of checkpoints), for the eval to report."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise CheckpointRefusedError(
            f"{_KEY}={path!r} does not exist (or is not a folder); point it at "
            "<run>/checkpoints/step_<n>, a run's checkpoints/ folder or a run folder"
        )
    rejected: list[str] = []
    if _is_one_checkpoint(folder):
        _check_one(path, folder)
    else:
        root = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
        found, rejected = latest_verified_checkpoint(root)
        if found is None:
            damaged = f"; damaged: {' | '.join(rejected)}" if rejected else ""
            raise CheckpointRefusedError(
                f"{_KEY}={path!r}: no complete checkpoint under {root} passes its manifest"
                f"{damaged}. Point it at a run whose checkpoint.every_n_steps saved one"
            )
        folder = found
    if not (folder / MODEL_FILE).is_file() and not (folder / ADAPTER_CONFIG_FILE).is_file():
        raise CheckpointRefusedError(
            f"{_KEY}={path!r}: {folder} holds no {MODEL_FILE} (a Megatron checkpoint keeps "
            "distributed shards); export it as a Hugging Face folder and evaluate that with "
            f"policy.source=pretrained policy.path=<folder> and {_KEY}=null"
        )
    return EvaluatedCheckpoint(folder, TrainerState.read(folder).step), rejected


def checkpoint_weights(checkpoint: EvaluatedCheckpoint) -> dict[str, torch.Tensor]:
    """Every named tensor of the model, as the engines' `update_weights` takes them: the file
    holds tied tensors once (`safetensors.torch.save_model`), its metadata the names it
    dropped and the one each shares storage with."""
    with safe_open(str(checkpoint.folder / MODEL_FILE), framework="pt") as weights:
        tensors = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118
        dropped = weights.metadata() or {}
    for name, kept in dropped.items():
        if kept in tensors and name not in tensors:
            tensors[name] = tensors[kept]
    return tensors


def checkpoint_adapter(checkpoint: EvaluatedCheckpoint) -> AdapterWeights:
    """The LoRA adapter of a LoRA run's checkpoint, as the engines' `update_adapter` takes it."""
    return AdapterWeights.read(checkpoint.folder)


def _is_one_checkpoint(folder: Path) -> bool:
    markers = (
        COMPLETE_MARKER,
        MANIFEST_FILE,
        STATE_FILE,
        LEGACY_STATE_FILE,
        MODEL_FILE,
        ADAPTER_CONFIG_FILE,
    )
    return bool(_ONE_CHECKPOINT.fullmatch(folder.name)) or any(
        (folder / marker).exists() for marker in markers
    )


def _check_one(path: str, folder: Path) -> None:
    if not (folder / COMPLETE_MARKER).is_file():
        raise CheckpointRefusedError(
            f"{_KEY}={path!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker: its "
            "save was interrupted, or it was copied partially); evaluate another step, or point "
            f"{_KEY} at its checkpoints/ folder for the newest complete one"
        )
    try:
        verify_checkpoint(folder)
    except CorruptCheckpointError as error:
        raise CheckpointRefusedError(
            f"{_KEY}={path!r} fails its manifest: {error}. Evaluate another step, or point "
            f"{_KEY} at its checkpoints/ folder for the newest one that passes"
        ) from None
