"""One evaluation, one folder: `episodes.jsonl` (one object per episode, appended and flushed as
each one ends, so an interrupted eval keeps what finished) and `summary.json` (the metrics and
what was evaluated, written once at the end, atomically). docs/evaluation.md describes both.

A folder that already holds an eval is refused before anything starts, as a run folder is
(`gymrl.run.folder`): appending a second eval's episodes to the first's would mix two policies.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

EPISODES_FILENAME = "episodes.jsonl"
SUMMARY_FILENAME = "summary.json"


class EvalFolderInUseError(RuntimeError):
    """An eval was pointed at a folder that already holds one."""


def claim_eval_folder(folder: Path) -> None:
    """Create `folder`, refusing one that holds another eval's files."""
    used = [name for name in (EPISODES_FILENAME, SUMMARY_FILENAME) if (folder / name).exists()]
    if used:
        raise EvalFolderInUseError(
            f"{folder} already holds an eval ({', '.join(used)}); set eval.output_dir=<empty "
            "folder>, or delete that one"
        )
    folder.mkdir(parents=True, exist_ok=True)


class EpisodeLog:
    """`episodes.jsonl` of an eval folder, one line per episode, flushed as written."""

    def __init__(self, folder: Path):
        self._file = (folder / EPISODES_FILENAME).open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_summary(folder: Path, summary: dict[str, Any]) -> Path:
    """Write `summary.json` atomically (a reader never sees half of it); NaN becomes null."""
    target = folder / SUMMARY_FILENAME
    staging = folder / f".{SUMMARY_FILENAME}.partial"
    staging.write_text(json.dumps(_jsonable(summary), indent=1, sort_keys=True) + "\n")
    os.replace(staging, target)
    return target


def read_summary(folder: Path) -> dict[str, Any]:
    return json.loads((folder / SUMMARY_FILENAME).read_text(encoding="utf-8"))


def is_eval_folder(folder: Path) -> bool:
    return (folder / SUMMARY_FILENAME).is_file()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value
