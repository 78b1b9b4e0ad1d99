"""One run, one folder: a fresh run never writes into a folder another run has used.

A run's records (`metrics.jsonl`, `checkpoints/`, the W&B files) are appended to as it goes, so a
second fresh run in the same folder would silently continue the first one's `metrics.jsonl` and,
with a W&B id derived from the folder, its W&B run. The recipe refuses that case before anything
starts: the folder is claimed by writing `run.json`, which holds the W&B run id that the run and
every `resume=true` of it share; a fresh run gets a new random id, so even a folder that was
deleted and reused never continues an old W&B run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_FILENAME = "run.json"
# What a run leaves in its folder; Hydra's own `.hydra/` is written before the run starts.
METRICS_FILENAME = "metrics.jsonl"  # one JSON object per logged step (gymrl.tracking)
TRAINED_ROWS_FILENAME = "trained_rows.jsonl"  # the rows each step trained on (append_trained_rows)
_USED_MARKERS = (RUN_FILENAME, METRICS_FILENAME, "checkpoints", "wandb")


class RunFolderInUseError(RuntimeError):
    """A fresh run was pointed at a folder that already holds another run."""


@dataclass(frozen=True)
class RunIdentity:
    """What ties the runs of one folder together: the W&B run id a resume continues."""

    wandb_run_id: str


def claim_run_folder(output_dir: Path, *, resume: bool) -> RunIdentity:
    """The folder's identity: the stored one on `resume`, a new one for a fresh run.

    Raises RunFolderInUseError when a fresh run finds another run's records in `output_dir`.
    """
    run_file = output_dir / RUN_FILENAME
    if resume and run_file.is_file():
        return RunIdentity(**json.loads(run_file.read_text()))
    if not resume:
        used = [name for name in _USED_MARKERS if (output_dir / name).exists()]
        if used:
            raise RunFolderInUseError(
                f"{output_dir} already holds a run ({', '.join(used)}); a fresh run there would "
                "append to its records. Continue that run with resume=true, start a new one "
                "elsewhere with run.name=<new name> (or run.output_dir=<empty folder>), or "
                "delete the folder."
            )
    # A resume of a folder written before run.json existed starts a new W&B run.
    identity = RunIdentity(wandb_run_id=secrets.token_hex(8))
    output_dir.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(asdict(identity)) + "\n")
    return identity


def append_trained_rows(
    output_dir: Path, step: int, rows: Sequence[tuple[int | None, str]]
) -> None:
    """Append one line to `trained_rows.jsonl`: the rows step `step` trained on, each as its
    position in the run's row stream and its id, in position order. Metrics cannot say which
    rows a step saw, and that is what shows a resumed run equal to an uninterrupted one end to
    end (in sync mode the same rows at every step; generation itself is not bit-exact,
    docs/reliability.md). A resume appends, as it does to metrics.jsonl."""
    record = {
        "step": step,
        "rows": [
            {"position": position, "row": row}
            for position, row in sorted(rows, key=lambda pair: (pair[0] is None, pair[0] or 0))
        ],
    }
    with (output_dir / TRAINED_ROWS_FILENAME).open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
