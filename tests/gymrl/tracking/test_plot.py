"""The run picture: per-agent series are read from metrics.jsonl records and drawn to a PNG."""

import json
import subprocess
import sys

from gymrl.tracking.plot import _per_agent_series, plot_run, plot_validation_runs
from gymrl.tracking.records import read_records

RECORDS = [
    {
        "step": 0,
        "validation/a/reward/mean": 0.25,
        "validation/a/reward/stderr": 0.1,
        "timing/validation_s": 3.0,
    },
    {
        "step": 1,
        "train/a/reward/mean": 0.0,
        "train/a/noncontiguous_truncated/mean": 1.0,
        "train/loss": 0.1,
        "timing/train_s": 2.0,
    },
    {
        "step": 2,
        "train/a/reward/mean": 0.5,
        "train/b/reward/mean": 1.0,
        "train/a/noncontiguous_truncated/mean": 0.5,
        "validation/a/reward/mean": 0.75,
        "validation/a/reward/stderr": None,
        "train/loss": 0.2,
        "timing/train_s": 1.5,
        "ledger/generated_tokens": 120.0,
        "ledger/trained_tokens": 80.0,
        "ledger/untrained_tokens/dropped_tail": 40.0,
        "ledger/a/generated_tokens": 120.0,
        "ledger/a/trained_tokens": 80.0,
    },
]


def test_per_agent_series_follow_the_steps_each_agent_appears_in():
    assert _per_agent_series(RECORDS, "reward") == {
        ("train", "a"): ([1, 2], [0.0, 0.5]),
        ("train", "b"): ([2], [1.0]),
        ("validation", "a"): ([0, 2], [0.25, 0.75]),
    }
    assert _per_agent_series(RECORDS, "noncontiguous_truncated") == {
        ("train", "a"): ([1, 2], [1.0, 0.5])
    }


def test_plot_run_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    picture = plot_run(read_records(metrics), tmp_path / "metrics.png", "run")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_runs_draw_one_validation_panel_per_agent_and_one_overall(tmp_path):
    overall = [{**r, "validation/reward/mean": 0.3} for r in RECORDS]
    runs = {"seed0": RECORDS, "seed1": overall}
    picture = plot_validation_runs(runs, tmp_path / "seeds.png", "seeds")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_needs_an_output_for_several_runs(tmp_path):
    paths = []
    for name in ("seed0", "seed1"):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
        paths.append(str(path))
    refused = subprocess.run(
        [sys.executable, "-m", "gymrl.tracking.plot", *paths], capture_output=True, text=True
    )
    assert refused.returncode == 2 and "name it with -o" in refused.stderr
    drawn = subprocess.run(
        [sys.executable, "-m", "gymrl.tracking.plot", *paths, "-o", str(tmp_path / "seeds.png")],
        capture_output=True,
        text=True,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "seeds.png").stat().st_size > 0
