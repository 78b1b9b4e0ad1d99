"""Sweep bookkeeping: swept keys, W&B labels per point, point records and the summary table."""

import json

from omegaconf import OmegaConf

from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config
from gymrl.run.folder import METRICS_FILENAME
from gymrl.tracking.sweep import (
    SWEEP_FILENAME,
    read_point,
    record_point,
    run_labels,
    summary_table,
    sweep_points,
    swept_keys,
)


def test_swept_keys_come_from_command_line_sweeps_and_the_sweepers_params():
    keys = swept_keys(
        ["+experiment=smoke", "grpo.num_steps=1,2", "loss.kl_coef=range(0,3)", "run.seed=4"],
        {"trainer.optimizer.lr": "interval(1e-5, 1e-3)"},
    )
    assert keys == ["grpo.num_steps", "loss.kl_coef", "trainer.optimizer.lr"]


def _hydra_cfg(sweep_dir, task):
    return OmegaConf.create(
        {
            "runtime": {"choices": {"experiment": "smoke"}},
            "sweep": {"dir": str(sweep_dir)},
            "overrides": {"task": task},
        }
    )


def test_a_sweep_point_gets_the_sweeps_group_the_experiment_and_its_swept_values(tmp_path):
    sweep_dir = tmp_path / "2026-01-01_00-00-00"
    sweep_dir.mkdir()
    (sweep_dir / SWEEP_FILENAME).write_text(json.dumps({"swept_keys": ["grpo.num_steps"]}))
    config = validate_config(compose_raw(["+experiment=smoke"]))
    task = ["+experiment=smoke", "grpo.num_steps=2", "run.seed=1"]
    labelled = run_labels(config, _hydra_cfg(sweep_dir, task), sweeping=True).logger.wandb
    assert labelled.group == "smoke-2026-01-01_00-00-00"
    assert labelled.job_type == "smoke"
    assert labelled.tags == ["smoke", "grpo.num_steps=2"]


def test_a_single_run_has_no_group_and_explicit_labels_win(tmp_path):
    config = validate_config(
        compose_raw(["+experiment=smoke", "logger.wandb.tags=[mine]", "logger.wandb.job_type=jt"])
    )
    labelled = run_labels(config, _hydra_cfg(tmp_path, []), sweeping=False).logger.wandb
    assert (labelled.group, labelled.job_type, labelled.tags) == (None, "jt", ["mine"])


def _point(sweep_dir, number, overrides, status, records=(), error=None):
    folder = sweep_dir / str(number)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    (folder / METRICS_FILENAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    record_point(folder, output_dir=folder, overrides=overrides, status=status, error=error)


def test_the_summary_lists_every_point_with_status_folder_and_final_metrics(tmp_path):
    _point(tmp_path, 0, ["a=1", "b=x"], "completed", [{"step": 1, "train/reward/mean": 0.25}])
    _point(tmp_path, 1, ["a=2", "b=x"], "failed", error="run stopped: Boom: at\nline two")
    for number in range(2, 11):  # job 10 sorts after job 9
        _point(tmp_path, number, [f"a={number + 1}", "b=x"], "completed", [{"step": 3}])
    points = sweep_points(tmp_path)
    assert [p.folder.name for p in points] == [str(n) for n in range(11)]
    table = summary_table(points, tmp_path).splitlines()
    assert table[0] == "| point | status | a | final step | train/reward/mean | folder | error |"
    assert table[2] == "| 0 | completed | 1 | 1 | 0.25 | 0 |  |"
    assert table[3] == "| 1 | failed | 2 |  |  | 1 | run stopped: Boom: at line two |"
    assert len(table) == 2 + 11


def test_a_plain_run_folder_reads_as_a_point_and_a_dead_one_as_unfinished(tmp_path):
    (tmp_path / "run" / METRICS_FILENAME).parent.mkdir()
    (tmp_path / "run" / METRICS_FILENAME).write_text('{"step": 1}\n')
    assert read_point(tmp_path / "run").status == "completed"
    (tmp_path / "dead").mkdir()
    assert read_point(tmp_path / "dead").status == "unfinished"
