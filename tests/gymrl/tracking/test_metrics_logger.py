"""Logger sinks: jsonl records, the console bar, W&B offline, and a logger with no sink."""

import json

import wandb

from gymrl.config.schema.logger import LoggerConfig
from gymrl.run.folder import METRICS_FILENAME
from gymrl.tracking.metrics_logger import build_logger


def _config(**fields):
    return LoggerConfig.model_validate(fields)


def _build(config, tmp_path, first_step=0):
    return build_logger(
        config,
        run_name="t",
        output_dir=tmp_path,
        hparams={"lr": 1e-4},
        total_steps=3,
        first_step=first_step,
        run_id="0123456789abcdef",
    )


def test_jsonl_appends_one_flushed_record_per_step_with_nonfinite_values_as_null(tmp_path):
    config = _config(jsonl=True, progress_bar=False, wandb={"mode": "disabled"})
    logger = _build(config, tmp_path)
    logger.log(1, {"train/loss": 0.5, "rollout/group_s/mean": float("nan")})
    # Flushed at once: readable while the run goes on.
    (record,) = [
        json.loads(line) for line in (tmp_path / METRICS_FILENAME).read_text().splitlines()
    ]
    assert record == {"step": 1, "train/loss": 0.5, "rollout/group_s/mean": None}
    logger.close()
    resumed = _build(config, tmp_path, first_step=1)  # a resumed run appends
    resumed.log(2, {"train/loss": 0.25})
    resumed.close()
    steps = [
        json.loads(line)["step"] for line in (tmp_path / METRICS_FILENAME).read_text().splitlines()
    ]
    assert steps == [1, 2]


def test_the_progress_bar_shows_the_watched_numbers(tmp_path, capsys):
    logger = _build(_config(jsonl=False, progress_bar=True, wandb={"mode": "disabled"}), tmp_path)
    logger.log(1, {"train/reward/mean": 0.25, "train/loss": 1.5, "other": 3.0})
    logger.close()
    shown = capsys.readouterr().err
    assert "1/3" in shown and "reward/mean=0.25" in shown and "loss=1.5" in shown
    assert not (tmp_path / METRICS_FILENAME).exists()


def test_with_every_sink_off_logging_is_a_no_op(tmp_path):
    logger = _build(_config(jsonl=False, progress_bar=False, wandb={"mode": "disabled"}), tmp_path)
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_writes_a_local_run_under_the_given_id_with_labels(tmp_path):
    config = _config(
        jsonl=False,
        progress_bar=False,
        wandb={"mode": "offline", "group": "sweep-a", "job_type": "smoke", "tags": ["x=1"]},
    )
    logger = _build(config, tmp_path)
    logger.log(1, {"train/loss": 1.0, "train/reward/mean": 0.5})
    # The labels as the live run holds them (the offline .wandb stream is written by W&B's
    # service process in the background, so its bytes are not a reliable thing to read back).
    run = wandb.run
    assert run is not None
    assert (run.id, run.group, run.job_type) == ("0123456789abcdef", "sweep-a", "smoke")
    assert tuple(run.tags) == ("x=1",)
    logger.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith("-0123456789abcdef")
