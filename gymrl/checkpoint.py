"""Save and resume the torch trainer: weights, optimizer, counters, data position and RNG states.

A checkpoint is a folder `step_<n>/` holding `model.safetensors`, `optimizer.pt`,
`trainer_state.json` and, written last, the marker `COMPLETE`. It is assembled in a hidden
temporary folder and renamed into place, so a crash mid-save never leaves a `step_<n>/` that looks
usable; the marker additionally guards against copies made by tools that do not rename atomically
(rsync, object-store syncs). :func:`latest_checkpoint` only ever returns marked folders.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp-step_"


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_state: Mapping[str, Any],
    extra: Mapping[str, Any],
    weight_version: int,
    keep_last: int,
) -> Path:
    """Write `directory/step_<step>/` atomically, keep the newest `keep_last`, return its path.

    `data_state` (where the data loader is) and `extra` (anything else the recipe resumes from)
    must be JSON-serialisable; that is checked before anything is written. Saving a step that
    already exists replaces it.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the checkpoint just written), got {keep_last}")
    state = {
        "step": step,
        "weight_version": weight_version,
        "data_state": dict(data_state),
        "extra": dict(extra),
        "rng": _rng_state(),
    }
    for name in ("data_state", "extra"):
        try:
            json.dumps(state[name])
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"save_checkpoint: {name} must be JSON-serialisable ({error}); convert tensors "
                "and other objects to numbers, strings, lists or dicts"
            ) from error
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftover_temporaries(root)
    staging = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step}-", dir=root))
    try:
        save_model(model, str(staging / MODEL_FILE))
        torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2))
        for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
            _fsync(staging / name)
        (staging / COMPLETE_MARKER).write_text(f"{step}\n")
        _fsync(staging / COMPLETE_MARKER)
        _fsync(staging)
        target = root / f"step_{step}"
        if target.exists():
            # Move the old copy aside first: a rename cannot replace a non-empty folder.
            replaced = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{step}-old-", dir=root))
            target.rename(replaced / target.name)
            staging.rename(target)
            shutil.rmtree(replaced)
        else:
            staging.rename(target)
        _fsync(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old)
    return target


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under `directory`, or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """Restore weights, optimizer state (unless `optimizer` is None) and RNG states from `path`.

    Returns `{"step", "weight_version", "data_state", "extra"}` for the recipe to resume from.
    """
    folder = Path(path)
    if not (folder / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint (no {COMPLETE_MARKER} marker); a save was "
            "interrupted or the folder was copied partially. Use latest_checkpoint() to find the "
            "newest complete one."
        )
    load_model(model, str(folder / MODEL_FILE), strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        )
    state = json.loads((folder / STATE_FILE).read_text())
    _restore_rng_state(state["rng"])
    return {key: state[key] for key in ("step", "weight_version", "data_state", "extra")}


def complete_checkpoints(root: Path) -> list[Path]:
    """Marked `step_<n>` folders under `root`, oldest step first."""
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]


def _remove_leftover_temporaries(root: Path) -> None:
    """Remove staging folders of saves that crashed; one trainer process saves into `root`."""
    for child in root.iterdir():
        if child.name.startswith(_TMP_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "torch": _encode_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _restore_rng_state(state: Mapping[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    torch.set_rng_state(_decode_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_bytes(s) for s in state["cuda"]])


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
