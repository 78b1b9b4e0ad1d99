"""One place every step's metrics go: W&B, `<output_dir>/metrics.jsonl` and the console.

Sinks share one interface so the training loop never branches on "is W&B on": a disabled sink is
simply absent. W&B runs offline by default (no account needed; `wandb sync <dir>` uploads later).
Metric keys are API and documented in docs/metrics.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Protocol

from tqdm import tqdm

from gymrl.config.schema.logger import LoggerConfig
from gymrl.run.folder import METRICS_FILENAME


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step with every logged key, appended and flushed at once."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{key: _jsonable(value) for key, value in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# The W&B x axis of every chart: the GRPO step, logged with each record (as in metrics.jsonl).
STEP_KEY = "step"
# Run summaries (the runs table, sweep comparisons) beyond W&B's default "last", first match wins.
SUMMARIES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(train|validation)/(.+/)?reward/mean$"), "last,max"),
    (re.compile(r"^train/(loss|pg_loss|kl)$"), "last,min"),
    (re.compile(r"^(timing|perf)/"), "mean,last"),
    (re.compile(r"^async/trajectory_age/max$"), "max"),
)


class WandbSink:
    """One W&B run per run folder: `run_id` comes from the folder's run.json, so a resume
    continues the same W&B run and a fresh run never does."""

    def __init__(
        self,
        config: LoggerConfig,
        run_name: str,
        output_dir: Path,
        hparams: dict,
        run_id: str,
    ):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=config.wandb.project,
            entity=config.wandb.entity,
            name=run_name,
            group=config.wandb.group,
            job_type=config.wandb.job_type,
            tags=config.wandb.tags,
            mode=config.wandb.mode,
            dir=str(output_dir),
            config=hparams,
            resume="allow",  # the id is this folder's alone (gymrl.run.folder)
            id=run_id,
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self._summarised: set[str] = set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key in metrics.keys() - self._summarised:
            self._summarised.add(key)
            summary = next((s for pattern, s in SUMMARIES if pattern.match(key)), None)
            if summary:
                self._run.define_metric(key, step_metric=STEP_KEY, summary=summary)
        self._run.log({STEP_KEY: step, **metrics})

    def close(self) -> None:
        self._run.finish()


class ProgressSink:
    """A console progress bar over steps, showing the numbers a person watches."""

    SHOWN: ClassVar[dict[str, str]] = {
        "train/reward/mean": "reward/mean",
        "validation/reward/mean": "val_reward/mean",
        "train/loss": "loss",
        "timing/step_s": "step_s",
    }

    def __init__(self, total_steps: int, first_step: int):
        self._bar = tqdm(total=total_steps, initial=first_step, desc="grpo", unit="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {
            label: f"{metrics[key]:.3g}" for key, label in self.SHOWN.items() if key in metrics
        }
        self._bar.set_postfix(shown, refresh=False)
        # Validation before the first step logs at the step already reached: the bar stays.
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()


class MetricsLogger:
    def __init__(self, sinks: list[MetricsSink]):
        self._sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self._sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def build_logger(
    config: LoggerConfig,
    *,
    run_name: str,
    output_dir: Path,
    hparams: dict[str, Any],
    total_steps: int,
    first_step: int,
    run_id: str,
) -> MetricsLogger:
    sinks: list[MetricsSink] = []
    if config.jsonl:
        sinks.append(JsonlSink(output_dir / METRICS_FILENAME))
    if config.wandb.mode != "disabled":
        sinks.append(WandbSink(config, run_name, output_dir, hparams, run_id))
    if config.progress_bar:
        sinks.append(ProgressSink(total_steps, first_step))
    return MetricsLogger(sinks)


def _jsonable(value: float) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None
