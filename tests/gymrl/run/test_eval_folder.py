"""An eval folder: claimed once, episodes appended line by line, the summary replaced whole."""

import json
import math

import pytest

from gymrl.run.eval_folder import (
    EpisodeLog,
    EvalFolderInUseError,
    claim_eval_folder,
    is_eval_folder,
    read_summary,
    write_summary,
)


def test_a_folder_holds_one_eval(tmp_path):
    folder = tmp_path / "eval" / "step_3"
    claim_eval_folder(folder)
    log = EpisodeLog(folder)
    log.write({"row_id": "a", "sample": 0})
    # Flushed as written: a reader (or an eval killed now) sees the line already.
    assert json.loads((folder / "episodes.jsonl").read_text()) == {"row_id": "a", "sample": 0}
    log.close()
    assert not is_eval_folder(folder)
    write_summary(folder, {"metrics": {"eval/reward/mean": math.nan, "eval/episodes": 1.0}})
    assert is_eval_folder(folder)
    assert read_summary(folder) == {"metrics": {"eval/reward/mean": None, "eval/episodes": 1.0}}
    assert {p.name for p in folder.iterdir()} == {"episodes.jsonl", "summary.json"}
    with pytest.raises(EvalFolderInUseError, match=r"already holds an eval.*eval\.output_dir"):
        claim_eval_folder(folder)
