"""Folders that appear whole or not at all: write into a staging folder, then rename it into place.

Checkpoints, the converted model cache and the weights a refit hands to SGLang are folders that
another process (a resumed run, a second worker, an SGLang server) may read at any moment; a
reader must never see one half written. A rename within one filesystem is atomic, so a folder is
assembled next to its target as `.tmp-<name>` and renamed when complete. The staging name is fixed
(not random) so that the ranks of a collective writer agree on it without talking, and so that a
crashed writer's leftover is found and removed by the next one; callers serialise writers of one
target (a file lock, a mutex, or rank 0 alone).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_PREFIX = ".tmp-"


def staging_folder(target: str | os.PathLike[str]) -> Path:
    """Where `target` is assembled: a hidden sibling, on the same filesystem."""
    target = Path(target)
    return target.parent / f"{STAGING_PREFIX}{target.name}"


def begin(target: str | os.PathLike[str]) -> Path:
    """Create an empty staging folder for `target` (removing a crashed writer's) and return it."""
    staging = staging_folder(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, target: str | os.PathLike[str], *, durable: bool) -> Path:
    """Rename the finished `staging` folder to `target`, replacing an older `target`.

    `durable` flushes every file and the folders to disk first, so that after a power loss the
    target is either absent or complete (checkpoints); without it, the rename is atomic for
    readers but the data may still sit in the page cache.
    """
    target = Path(target)
    if durable:
        for path in sorted(staging.rglob("*")):
            _fsync(path)
        _fsync(staging)
    if target.exists():
        # A rename cannot replace a non-empty folder: move the old copy aside, then drop it.
        retired = target.parent / f"{STAGING_PREFIX}retired-{target.name}"
        shutil.rmtree(retired, ignore_errors=True)
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired)
    else:
        staging.rename(target)
    if durable:
        _fsync(target.parent)
    return target


@contextmanager
def atomic_folder(target: str | os.PathLike[str], *, durable: bool) -> Iterator[Path]:
    """Yield a staging folder to fill; on a clean exit it becomes `target`, on an error it is
    removed and `target` (if it existed) is left as it was."""
    staging = begin(target)
    try:
        yield staging
        publish(staging, target, durable=durable)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
