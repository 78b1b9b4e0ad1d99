"""Run folders: a fresh run refuses a used folder; a resume keeps the folder's W&B run id."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gymrl.run.folder import METRICS_FILENAME, RUN_FILENAME, RunFolderInUseError, claim_run_folder

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
