"""Run folders: a fresh run refuses a used folder; a resume keeps the folder's W&B run id and
starts over where no step ever ended; each step's rows are recorded."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gymrl.config.compose import compose_raw
from gymrl.experience.producer import DataState
from gymrl.preflight.validate import validate_config
from gymrl.recipes.training import GRPORecipe
from gymrl.run.folder import (
    METRICS_FILENAME,
    RUN_FILENAME,
    TRAINED_ROWS_FILENAME,
    RunFolderInUseError,
    append_trained_rows,
    claim_run_folder,
)

ROOT = Path(__file__).resolve().parents[3]


def test_a_fresh_run_claims_an_empty_folder_with_a_new_wandb_id(tmp_path):
    first = claim_run_folder(tmp_path / "a", resume=False)
    second = claim_run_folder(tmp_path / "b", resume=False)
    assert first.wandb_run_id != second.wandb_run_id
    stored = json.loads((tmp_path / "a" / RUN_FILENAME).read_text())
    assert stored == {"wandb_run_id": first.wandb_run_id}


def test_resume_continues_the_folders_wandb_run(tmp_path):
    fresh = claim_run_folder(tmp_path, resume=False)
    assert claim_run_folder(tmp_path, resume=True) == fresh


@pytest.mark.parametrize("leftover", [RUN_FILENAME, METRICS_FILENAME, "checkpoints", "wandb"])
def test_a_fresh_run_refuses_a_folder_another_run_used(tmp_path, leftover):
    if leftover == "checkpoints" or leftover == "wandb":
        (tmp_path / leftover).mkdir()
    else:
        (tmp_path / leftover).write_text("{}\n")
    with pytest.raises(RunFolderInUseError, match=r"resume=true.*run\.name=") as refused:
        claim_run_folder(tmp_path, resume=False)
    assert str(tmp_path) in str(refused.value) and leftover in str(refused.value)


def test_a_deleted_and_reused_folder_gets_a_new_wandb_run(tmp_path):
    old = claim_run_folder(tmp_path, resume=False)
    (tmp_path / RUN_FILENAME).unlink()
    assert claim_run_folder(tmp_path, resume=False) != old


def test_the_entry_point_refuses_a_fresh_run_in_a_used_folder_before_starting(tmp_path):
    """What a user sees running the same fresh command twice: one message, nothing appended."""
    (tmp_path / METRICS_FILENAME).write_text('{"step": 1}\n')
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "+experiment=smoke",
            f"run.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "run stopped: RunFolderInUseError:" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / METRICS_FILENAME).read_text() == '{"step": 1}\n'
    assert not (tmp_path / RUN_FILENAME).exists()


def test_each_step_appends_its_rows_in_position_order(tmp_path):
    append_trained_rows(tmp_path, 1, [(1, "guess-0"), (0, "calc-0")])
    append_trained_rows(tmp_path, 2, [(3, "guess-1"), (2, "calc-1")])
    lines = (tmp_path / TRAINED_ROWS_FILENAME).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "rows": [{"position": 0, "row": "calc-0"}, {"position": 1, "row": "guess-0"}]},
        {"step": 2, "rows": [{"position": 2, "row": "calc-1"}, {"position": 3, "row": "guess-1"}]},
    ]


def _recipe(output_dir: Path) -> GRPORecipe:
    """The recipe of a resumed smoke run in `output_dir`, not set up: `_resume` reads the folder
    (and the trainer only once it found a checkpoint)."""
    config = validate_config(compose_raw(["+experiment=smoke", "resume=true"]))
    return GRPORecipe(config, output_dir)


def test_a_resume_of_a_run_that_never_ended_a_step_starts_at_step_zero(tmp_path):
    """A Slurm job stopped during its setup and requeued by launch/ray.sub with resume=true:
    nothing was trained, so the run starts over in its folder instead of refusing."""
    claim_run_folder(tmp_path, resume=False)
    assert _recipe(tmp_path)._resume() == (0, DataState(0))


def test_a_resume_of_a_run_that_ended_a_step_but_saved_none_refuses(tmp_path):
    claim_run_folder(tmp_path, resume=False)
    append_trained_rows(tmp_path, 1, [(0, "calc-0")])
    with pytest.raises(FileNotFoundError, match="resume=true but there is no complete checkpoint"):
        _recipe(tmp_path)._resume()
