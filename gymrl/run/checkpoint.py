"""Checkpoints of both trainers: one folder layout and one resume state, whatever the backend.

A checkpoint is a folder `step_<n>/` holding the backend's weights and optimizer state (the torch
trainer: `model.safetensors` and `optimizer.pt`, or with `trainer.lora` the adapter alone in
PEFT's format, `adapter_config.json` and `adapter_model.safetensors`; Megatron: a distributed
checkpoint under `megatron/`), `gymrl_state.json` (:class:`TrainerState`), `MANIFEST.json` (the
size and xxh3-128 digest of every other file) and, written last, the marker `COMPLETE`. It is
assembled in a staging folder and renamed into place (`gymrl.run.atomic.atomic_folder`), so a
crash mid-save never leaves a `step_<n>/` that looks usable; the marker additionally guards
against copies made by tools that do not rename atomically (rsync, object-store syncs).
:func:`latest_checkpoint` only ever returns marked folders.

The marker says a save finished; it cannot say the bytes are still the ones written. A full disk
that truncated a file the writer did not check, a copy cut short, bit rot on a shared filesystem:
each leaves a marked folder that loads garbage or fails deep inside torch. So a resume goes
through :func:`latest_verified_checkpoint`, which checks every file against the manifest, reports
each checkpoint that fails and falls back to the newest one that passes.

The manifest's hash is xxh3-128, not a cryptographic one: it guards against accidents, not an
attacker who can rewrite the manifest too, and it runs at memory speed (4.6 GB/s against SHA-256's
0.7 GB/s on one core here, benchmarks/README.md), where a 30B checkpoint of ~430 GB took ~7 minutes
per save and per resume. Files are read in 16 MiB chunks and hashed in a thread pool (xxhash and
hashlib release the GIL), and with Megatron each rank hashes the shards it wrote. The manifest
names its hash; one without the field is from before xxh3 and holds SHA-256 digests, which still
verify, so a checkpoint of an earlier version still resumes.

The resume state is the same for both trainers: the step, the weight version the generation
engines must be refitted to, where the data stream is, and the RNG states (Python, NumPy, torch
and CUDA) of every trainer rank, so that a resumed run draws the same random numbers an
uninterrupted one would have. Anything backend-specific (Megatron's learning-rate scheduler) goes
in `extra`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch
import xxhash
from safetensors.torch import load_model, save_model

from gymrl.run.adapter import ADAPTER_CONFIG_FILE, AdapterWeights
from gymrl.run.atomic import STAGING_PREFIX, atomic_folder

if TYPE_CHECKING:
    from peft import PeftModel

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "gymrl_state.json"
# The state's name before issue 22: the Hugging Face Trainer writes a file of this name with
# another schema, so whoever found one could not tell which it was. Still read: old checkpoints
# resume.
LEGACY_STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "MANIFEST.json"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_HASH = "xxh3_128"
# Manifests without a "hash" field were written before xxh3, with SHA-256.
_LEGACY_MANIFEST_HASH = "sha256"
# Few system calls per GB, and small enough for one buffer per hashing thread.
_HASH_CHUNK = 16 << 20
_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class TrainerState:
    """What a trainer resumes from besides weights and optimizer state.

    `rng` holds one entry per trainer rank (index = global rank), each from
    :func:`capture_rng_state`. `data_state` and `extra` must be JSON-serialisable; that is checked
    at construction, before anything is written.
    """

    step: int
    weight_version: int
    data_state: dict[str, Any]
    rng: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        for name in ("data_state", "extra"):
            try:
                json.dumps(getattr(self, name))
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"checkpoint {name} must be JSON-serialisable ({error}); convert tensors "
                    "and other objects to numbers, strings, lists or dicts"
                ) from error

    def resume_info(self) -> dict[str, Any]:
        """What the loop resumes from: `{"step", "weight_version", "data_state", "extra"}`."""
        return {
            "step": self.step,
            "weight_version": self.weight_version,
            "data_state": self.data_state,
            "extra": self.extra,
        }

    def write(self, folder: Path, hashed: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Write `gymrl_state.json`, the manifest of every file in `folder`, then the
        `COMPLETE` marker: the last files of a save, after the backend wrote its own. `hashed`:
        manifest entries other ranks made of the files they wrote (:func:`write_manifest`)."""
        (folder / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))
        write_manifest(folder, hashed)
        (folder / COMPLETE_MARKER).write_text(f"{self.step}\n")

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> TrainerState:
        """The state of a complete checkpoint (refuses a folder without the marker)."""
        folder = Path(folder)
        if not (folder / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"{folder} is not a complete checkpoint (no {COMPLETE_MARKER} marker); a save was "
                "interrupted or the folder was copied partially. Use latest_checkpoint() to find "
                "the newest complete one."
            )
        state_file = folder / STATE_FILE
        if not state_file.is_file() and (folder / LEGACY_STATE_FILE).is_file():
            state_file = folder / LEGACY_STATE_FILE
        return cls(**json.loads(state_file.read_text()))


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    *,
    keep_last: int,
) -> Path:
    """Write the torch trainer's `directory/step_<step>/` atomically, keep the newest
    `keep_last`, return its path. Saving a step that already exists replaces it. A `PeftModel`
    saves its adapter alone, as PEFT does (the base weights are the policy's, unchanged)."""
    check_keep_last(keep_last)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    remove_leftover_staging(root)
    target = root / f"step_{state.step}"
    with atomic_folder(target, durable=True) as staging:
        if _is_peft(model):
            model.save_pretrained(str(staging))
        else:
            save_model(model, str(staging / MODEL_FILE))
        torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        state.write(staging)
    prune_checkpoints(root, keep_last)
    return target


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> TrainerState:
    """Restore the torch trainer's weights, optimizer state (unless `optimizer` is None) and RNG
    states from `path`, and return its state. A `PeftModel` loads the adapter of a LoRA
    checkpoint, which must have the shape the model's adapter has."""
    state = TrainerState.read(path)
    folder = Path(path)
    has_adapter = (folder / ADAPTER_CONFIG_FILE).is_file()
    if has_adapter != _is_peft(model):
        held, trains = ("an adapter", "every weight") if has_adapter else ("every weight", "LoRA")
        raise ValueError(
            f"{folder} holds {held} and this trainer trains {trains}: resume it with "
            f"trainer.lora.enabled={str(has_adapter).lower()} (and the adapter's shape)"
        )
    if _is_peft(model):
        _load_adapter(folder, model)
    else:
        load_model(model, str(folder / MODEL_FILE), strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        )
    restore_rng_state(state.rng[0])
    return state


_ADAPTER_SHAPE = ("r", "lora_alpha", "target_modules", "use_rslora")


def check_adapter_shape(
    folder: Path, saved: Mapping[str, Any], configured: Mapping[str, Any]
) -> None:
    """Refuse, by field, a checkpoint's adapter (`saved`, PEFT's config fields) whose shape is not
    the configured one's: both trainers resume an adapter only into one of its own shape."""

    def shape(config: Mapping[str, Any]) -> dict[str, Any]:
        fields = {key: config.get(key) for key in _ADAPTER_SHAPE}
        fields["target_modules"] = sorted(fields["target_modules"] or [])
        return fields

    differ = {
        key: (value, shape(configured)[key])
        for key, value in shape(saved).items()
        if value != shape(configured)[key]
    }
    if differ:
        raise ValueError(
            f"{folder}'s adapter differs from the configured one (saved, configured): {differ}; "
            "resume with trainer.lora set as the run that saved it"
        )


def _is_peft(model: torch.nn.Module) -> TypeGuard[PeftModel]:
    """Whether `model` is a PEFT model. A process that never imported peft made none, and need
    not import it (seconds) to save or load a full model: the driver and Megatron's ranks."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _load_adapter(folder: Path, model: PeftModel) -> None:
    """Load a checkpoint's adapter into `model`'s, refusing one of another shape by field (a
    rank or target set that differs would fail deep in torch, or load a part of it)."""
    saved = AdapterWeights.read(folder)
    check_adapter_shape(folder, saved.config, model.peft_config["default"].to_dict())
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, saved.tensors)
    # PEFT reports every base weight as missing (they are not in an adapter); none of the
    # adapter's own may be.
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder}'s adapter does not fit the model: missing {missing}, "
            f"unexpected {list(result.unexpected_keys)}"
        )


class CorruptCheckpointError(RuntimeError):
    """A marked checkpoint whose files do not match its manifest."""


def hash_files(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size and digest) of the files `names` under `folder`, hashed in parallel:
    a checkpoint's few large files would otherwise be read one after another."""
    names = list(names)
    sizes = [(folder / name).stat().st_size for name in names]
    with ThreadPoolExecutor() as pool:
        digests = pool.map(digest_file, (folder / name for name in names))
        return {
            name: {"bytes": size, MANIFEST_HASH: digest}
            for name, size, digest in zip(names, sizes, digests, strict=True)
        }


def write_manifest(folder: Path, hashed: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Record the size and digest of every file under `folder` in `MANIFEST.json`, hashing those
    not already in `hashed` (entries of :func:`hash_files` that other ranks made)."""
    hashed = dict(hashed or {})
    names = [
        path.relative_to(folder).as_posix()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in (MANIFEST_FILE, COMPLETE_MARKER)
    ]
    hashed.update(hash_files(folder, [name for name in names if name not in hashed]))
    files = {name: hashed[name] for name in sorted(hashed)}
    (folder / MANIFEST_FILE).write_text(
        json.dumps({"hash": MANIFEST_HASH, "files": files}, indent=2)
    )


def verify_checkpoint(folder: str | os.PathLike[str]) -> None:
    """Raise :class:`CorruptCheckpointError` naming every file of `folder` that is missing,
    of the wrong size or of the wrong content; return if all match the manifest. Files are
    checked in parallel."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        algorithm = manifest.get("hash", _LEGACY_MANIFEST_HASH)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"{folder}: no readable {MANIFEST_FILE} ({type(error).__name__}: {error}); it was "
            "cut short, or written before checkpoints carried checksums"
        ) from None
    if algorithm not in _DIGESTS:
        raise CorruptCheckpointError(
            f"{folder}: {MANIFEST_FILE} names the hash {algorithm!r}, which this version cannot "
            f"check (it knows {sorted(_DIGESTS)}); resume it with the version that wrote it"
        )

    def problem(item: tuple[str, dict[str, Any]]) -> str | None:
        name, expected = item
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, not {expected['bytes']}"
        if digest_file(path, algorithm) != expected.get(algorithm):
            return f"{name} does not match its {_HASH_NAMES[algorithm]}"
        return None

    with ThreadPoolExecutor() as pool:
        problems = [found for found in pool.map(problem, files.items()) if found]
    if problems:
        raise CorruptCheckpointError(f"{folder}: " + "; ".join(problems))


def latest_verified_checkpoint(
    directory: str | os.PathLike[str],
) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under `directory` whose files match its manifest (None if
    none), and one sentence per newer checkpoint that failed the check, for the run to report."""
    root = Path(directory)
    rejected: list[str] = []
    if not root.is_dir():
        return None, rejected
    for candidate in reversed(complete_checkpoints(root)):
        try:
            verify_checkpoint(candidate)
        except CorruptCheckpointError as error:
            rejected.append(str(error))
            continue
        return candidate, rejected
    return None, rejected


def digest_file(path: Path, algorithm: str = MANIFEST_HASH) -> str:
    """The hex digest of the file at `path` with a manifest hash (`xxh3_128`, or `sha256` of
    manifests written before it)."""
    return _DIGESTS[algorithm](path)


def _xxh3_128(path: Path) -> str:
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(_HASH_CHUNK))
    with path.open("rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(buffer[:read])
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


_DIGESTS: dict[str, Callable[[Path], str]] = {
    MANIFEST_HASH: _xxh3_128,
    _LEGACY_MANIFEST_HASH: _sha256,
}
_HASH_NAMES = {MANIFEST_HASH: "xxh3-128", _LEGACY_MANIFEST_HASH: "SHA-256"}


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under `directory`, or None."""
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Marked `step_<n>` folders under `root`, oldest step first."""
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]


def check_keep_last(keep_last: int) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the checkpoint just written), got {keep_last}")


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints."""
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old)


def remove_leftover_staging(root: Path) -> None:
    """Remove staging folders of saves that crashed; one trainer saves into `root` at a time."""
    for child in root.iterdir():
        if child.name.startswith(STAGING_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


# ------------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON: Python, NumPy, torch's CPU generator and, once CUDA is
    in use, every visible GPU's."""
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": np.asarray(keys).tolist(),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gauss),
        },
        "torch": _encode_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` in this process."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            np.array(numpy["keys"], dtype=np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(_decode_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_bytes(s) for s in state["cuda"]])


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
