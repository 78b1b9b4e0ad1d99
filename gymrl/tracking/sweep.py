"""Sweeps as a whole: W&B labels for each point, a record per point, a summary of the sweep.

`python recipes/grpo.py -m KEY=a,b ...` runs one recipe job per point, each in its own folder
under the sweep folder (`hydra.sweep.dir`). Hydra knows the points only one at a time, so this
module ties them together:

- `SweepCallback` (a Hydra callback, `hydra.callbacks` in conf/grpo.yaml) writes `sweep.json` with
  the swept keys when the sweep starts (from the command line and `hydra.sweeper.params`), and when
  it ends prints and writes `summary.md` listing every point with its status, folder and final
  metrics; the sweep exits with status 1 after the summary if any point failed.
- `run_labels` gives each point's W&B run the sweep's group, the experiment as job type and the
  swept `key=value` pairs as tags.
- `record_point` writes `point.json` into the point's folder: the recipe calls it for every point,
  failed or not, so a failing point is recorded and the sweep goes on to the next one.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.conf import HydraConf
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gymrl.config.schema.recipe import RecipeConfig
from gymrl.run.folder import METRICS_FILENAME
from gymrl.tracking.records import read_records

SWEEP_FILENAME = "sweep.json"
POINT_FILENAME = "point.json"
SUMMARY_FILENAME = "summary.md"
_TAG_LIMIT = 64  # W&B's longest tag
# The final metrics a summary shows (when the point logged them).
SUMMARY_METRICS = (
    "train/reward/mean",
    "train/loss",
    "rollout/failures_total",
    "async/trajectory_age/mean",
    "timing/step_s",
)


@dataclass(frozen=True)
class Point:
    """One point of a sweep as its folder records it."""

    folder: Path  # the point's Hydra folder (holds .hydra/ and point.json)
    output_dir: Path  # the run's folder (metrics.jsonl); the same unless run.output_dir is set
    overrides: list[str]
    status: str  # completed | failed | unfinished (no point.json: the process died)
    error: str | None
    objective: float | None
    records: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.records[-1] if self.records else {}


def swept_keys(task_overrides: list[str], sweeper_params: dict[str, Any]) -> list[str]:
    """Keys that vary across the sweep: command-line sweeps (`a=1,2`) and the sweeper's params."""
    parsed = OverridesParser.create().parse_overrides(task_overrides)
    keys = {o.key_or_group for o in parsed if o.is_sweep_override()} | set(sweeper_params)
    return sorted(key.lstrip("+~") for key in keys)


def run_labels(config: RecipeConfig, hydra_cfg: HydraConf, *, sweeping: bool) -> RecipeConfig:
    """The config with the W&B group, job type and tags filled in where they are null."""
    wandb = config.logger.wandb
    experiment = hydra_cfg.runtime.choices.get("experiment")  # absent without +experiment
    labels: dict[str, Any] = {}
    if wandb.job_type is None and experiment:
        labels["job_type"] = str(experiment)
    tags = [str(experiment)] if experiment else []
    if sweeping:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        if wandb.group is None:
            labels["group"] = f"{config.run.name}-{sweep_dir.name}"
        sweep_file = sweep_dir / SWEEP_FILENAME
        keys = json.loads(sweep_file.read_text())["swept_keys"] if sweep_file.is_file() else []
        for key, value in split_overrides(list(hydra_cfg.overrides.task)):
            if key in keys:
                tags.append(f"{key}={value}"[:_TAG_LIMIT])
    if wandb.tags is None:
        labels["tags"] = tags
    if not labels:
        return config
    logger = config.logger.model_copy(update={"wandb": wandb.model_copy(update=labels)})
    return config.model_copy(update={"logger": logger})


def record_point(
    folder: Path,
    *,
    output_dir: Path,
    overrides: list[str],
    status: str,
    error: str | None = None,
    objective: float | None = None,
) -> None:
    record = {
        "status": status,
        "output_dir": str(output_dir),
        "overrides": overrides,
        "error": error,
        "objective": objective if objective is not None and math.isfinite(objective) else None,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POINT_FILENAME).write_text(json.dumps(record, indent=1) + "\n")


def read_point(folder: Path) -> Point:
    """A point from its folder: its point.json, or (a plain run folder) its metrics alone."""
    overrides_file = folder / ".hydra" / "overrides.yaml"
    overrides = (
        [str(o) for o in OmegaConf.load(overrides_file)]  # a list: Hydra writes one override a line
        if overrides_file.is_file()
        else []
    )
    point_file = folder / POINT_FILENAME
    if point_file.is_file():
        record = json.loads(point_file.read_text())
        output_dir = Path(record["output_dir"])
        status, error, objective = record["status"], record["error"], record["objective"]
        overrides = record["overrides"]
    else:
        output_dir, error, objective = folder, None, None
        status = "completed" if (folder / METRICS_FILENAME).is_file() else "unfinished"
    metrics = output_dir / METRICS_FILENAME
    records = read_records(metrics) if metrics.is_file() else []
    return Point(folder, output_dir, overrides, status, error, objective, records)


def sweep_points(sweep_dir: Path) -> list[Point]:
    """Every point of a sweep folder: each subfolder Hydra made for a job, in job order."""
    folders = [p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")]
    return [read_point(folder) for folder in sorted(folders, key=_job_order)]


def _job_order(folder: Path) -> tuple[int, int, str]:
    """Hydra's job numbers in numeric order (10 after 9), other folder names after them."""
    return (0, int(folder.name), "") if folder.name.isdigit() else (1, 0, folder.name)


def varied_keys(points: list[Point]) -> list[str]:
    """Override keys whose value differs between the points (absent counts as a value)."""
    chosen = [dict(split_overrides(point.overrides)) for point in points]
    keys = {key for overrides in chosen for key in overrides}
    return sorted(key for key in keys if len({c.get(key) for c in chosen}) > 1)


def split_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """`+a.b=v` -> ("a.b", "v"): the key without Hydra's add/delete prefix."""
    pairs = []
    for override in overrides:
        key, _, value = override.partition("=")
        pairs.append((key.lstrip("+~"), value))
    return pairs


def summary_table(points: list[Point], sweep_dir: Path) -> str:
    """A Markdown table: every point with its status, folder and final metrics."""
    keys = varied_keys(points)
    metrics = [m for m in SUMMARY_METRICS if any(m in p.final for p in points)]
    header = ["point", "status", *keys, "final step", *metrics, "folder", "error"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for number, point in enumerate(points):
        chosen = dict(split_overrides(point.overrides))
        final = point.final
        row = [
            str(number),
            point.status,
            *(chosen.get(key, "") for key in keys),
            str(final.get("step", "")),
            *(_number(final.get(metric)) for metric in metrics),
            _relative(point.folder, sweep_dir),
            " ".join((point.error or "").split())[:160],
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else ""


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


class SweepCallback(Callback):
    """Hydra callback: the swept keys at the start of a multirun, the summary at its end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        params = OmegaConf.select(config, "hydra.sweeper.params") or {}
        keys = swept_keys(list(config.hydra.overrides.task), dict(params))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / SWEEP_FILENAME).write_text(json.dumps({"swept_keys": keys}) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        points = sweep_points(sweep_dir)
        table = summary_table(points, sweep_dir)
        (sweep_dir / SUMMARY_FILENAME).write_text(f"# Sweep {sweep_dir}\n\n{table}\n")
        print(f"\nsweep {sweep_dir}: {len(points)} point(s)\n{table}", flush=True)
        failed = [str(n) for n, p in enumerate(points) if p.status != "completed"]
        if failed:
            print(
                f"sweep failed: {len(failed)} of {len(points)} point(s) did not complete (point "
                f"{', '.join(failed)}); the others ran. See {sweep_dir / SUMMARY_FILENAME}.",
                file=sys.stderr,
                flush=True,
            )
            # Hydra turns a callback's exception into a warning; the exit status must say it.
            raise SystemExit(1)
