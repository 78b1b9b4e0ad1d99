"""The offline sweep report, read back in a real headless browser (Debian's Chromium).

Chromium loads the page with every network request sent to a closed port, takes a screenshot and
dumps the DOM it built: the table must list every point, and every point's line colour must be on
the screenshot's charts. Outside CI the browser test skips where Chromium is not installed; in CI
(`.ci/run` installs it) a missing browser fails it.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from omegaconf import OmegaConf

from gymrl.run.eval_folder import write_summary
from gymrl.run.folder import METRICS_FILENAME
from gymrl.tracking.eval_report import find_evaluations
from gymrl.tracking.report import REPORT_FILENAME, load_points, render
from gymrl.tracking.sweep import record_point

ROOT = Path(__file__).resolve().parents[3]
# matplotlib's first three line colours: one per point, in point order.
POINT_COLOURS = [(0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)]


def make_sweep(sweep_dir: Path) -> None:
    """Three points of `loss.kl_coef=0,0.1,0.2`; the last failed after one step."""
    for number, kl in enumerate(("0", "0.1", "0.2")):
        folder = sweep_dir / str(number)
        (folder / ".hydra").mkdir(parents=True)
        overrides = ["+experiment=smoke", f"loss.kl_coef={kl}"]
        (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
        steps = 1 if number == 2 else 4
        records = [
            {
                "step": step,
                "train/reward/mean": 0.1 * step + 0.05 * number,
                "train/loss": 1.0 / step,
                "train/calculator_agent/reward/mean": 0.2 * step / 4 + 0.1 * number,
                "train/calculator_agent/noncontiguous_truncated/mean": 0.05 * number,
                "train/guess_number_agent/reward/mean": 0.1 * step / 4,
                "train/guess_number_agent/noncontiguous_truncated/mean": 0.0,
            }
            for step in range(1, steps + 1)
        ]
        (folder / METRICS_FILENAME).write_text("".join(json.dumps(r) + "\n" for r in records))
        status, error = (
            ("failed", "run stopped: TimeoutError: no batch")
            if number == 2
            else (
                "completed",
                None,
            )
        )
        record_point(folder, output_dir=folder, overrides=overrides, status=status, error=error)


def test_the_page_compares_the_points_and_needs_nothing_from_elsewhere(tmp_path):
    make_sweep(tmp_path)
    page = render(load_points([tmp_path]), "t")
    assert page.count("<tr class='point'>") == 3
    assert page.count("<figure class='chart'") == 2 * 2 + 2  # 2 agents x 2 fields, reward, loss
    assert "keys that vary: <code>loss.kl_coef</code>" in page
    # Only references inside the page (SVG clip paths and markers: `url(#id)`, `href="#id"`).
    outside = re.findall(r"src=|<link|<script|@import|url\((?!#)|href=\"(?!#)", page)
    assert not outside, outside


def test_the_command_writes_report_html_into_the_sweep_folder(tmp_path):
    make_sweep(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "gymrl.tracking.report", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / REPORT_FILENAME)


def make_eval(folder: Path, label: str, step: int, calc_pass_at_4: float) -> None:
    """An eval folder as recipes/eval.py leaves it (its summary.json; gymrl.run.eval_folder)."""
    folder.mkdir(parents=True)
    metrics = {"eval/reward/mean": 0.4, "eval/episodes": 8.0, "eval/failures": 0.0}
    for agent, reward in (("calculator_agent", 0.3), ("guess_number_agent", 0.5)):
        metrics |= {
            f"eval/{agent}/reward/mean": reward,
            f"eval/{agent}/reward/stderr": 0.05,
            f"eval/{agent}/pass@1": reward / 2,
            f"eval/{agent}/pass@4": calc_pass_at_4 if agent == "calculator_agent" else 0.75,
            f"eval/{agent}/failure_rate": 0.0,
        }
    summary = {
        "label": label,
        "step": step,
        "checkpoint": None if step == 0 else f"/runs/learn/checkpoints/step_{step}",
        "policy": "SmolLM2-135M-Instruct",
        "rows": 4,
        "num_samples": 4,
        "temperature": 0.7,
        "success_threshold": 1.0,
        "pass_at_k": [1, 4],
        "complete": True,
        "wall_s": 60.0,
        "metrics": metrics,
    }
    write_summary(folder, summary)


def test_eval_folders_are_compared_side_by_side_with_the_runs(tmp_path):
    make_sweep(tmp_path / "sweep")
    make_eval(tmp_path / "learn" / "eval" / "start", "start", 0, calc_pass_at_4=0.125)
    make_eval(tmp_path / "learn" / "eval" / "step_12", "step_12", 12, calc_pass_at_4=0.625)
    # A folder of eval folders means each of them, in name order.
    evaluations = find_evaluations(tmp_path / "learn" / "eval")
    assert [e.title for e in evaluations] == ["start of learn", "step_12 of learn"]
    page = render(load_points([tmp_path / "sweep"]), "t", evaluations)
    assert page.count("<tr class='point'>") == 3  # the runs' section is still there
    table = page[page.index("<table id='evaluations'>") :]
    assert "<tr><th>eval</th><td>start of learn</td><td>step_12 of learn</td></tr>" in table
    assert "<td>starting (policy.*)</td><td>/runs/learn/checkpoints/step_12</td>" in table
    calculator = table[table.index("calculator_agent") : table.index("guess_number_agent")]
    assert "<tr><th>pass@4</th><td>0.125</td><td>0.625</td></tr>" in calculator
    assert "<tr><th>reward</th><td>0.3 ± 0.05</td><td>0.3 ± 0.05</td></tr>" in calculator
    charts = re.findall(r"<figure class='chart' data-key='([^']+)'", page)
    assert charts[-3:] == ["reward/mean", "pass@1", "pass@4"]


def test_the_command_takes_eval_folders_alone(tmp_path):
    make_eval(tmp_path / "a", "start", 0, calc_pass_at_4=0.1)
    make_eval(tmp_path / "b", "step_3", 3, calc_pass_at_4=0.2)
    output = tmp_path / "compare.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gymrl.report",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "-o",
            str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    page = output.read_text()
    assert "<h1>Eval report: " in page and "<h2>Final metrics</h2>" not in page
    assert "<tr><th>eval</th><td>a</td><td>b</td></tr>" in page


def chromium() -> str:
    found = shutil.which("chromium")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("CI must have Debian's chromium: .ci/run installs it")
    pytest.skip("Debian's chromium is not installed here (apt-get install -y chromium)")


def headless(browser: str, profile: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--proxy-server=127.0.0.1:9",  # any request the page made would fail
            "--hide-scrollbars",
            "--window-size=1300,2200",
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chromium_renders_the_table_and_the_charts(tmp_path):
    browser = chromium()
    sweep_dir = tmp_path / "sweep"
    make_sweep(sweep_dir)
    page = sweep_dir / REPORT_FILENAME
    page.write_text(render(load_points([sweep_dir]), "sweep"), encoding="utf-8")

    dom = headless(browser, tmp_path / "profile-dom", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert dom.stdout.count('<tr class="point">') == 3, dom.stdout[:3000]
    for label in ("loss.kl_coef=0", "loss.kl_coef=0.1", "loss.kl_coef=0.2", "failed"):
        assert label in dom.stdout

    screenshot = tmp_path / "report.png"
    shot = headless(browser, tmp_path / "profile-shot", f"--screenshot={screenshot}", page.as_uri())
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-3000:]
    pixels = (matplotlib.image.imread(screenshot)[..., :3] * 255).round().astype(int)
    assert (pixels < 250).any(axis=-1).mean() > 0.02, "the page is (nearly) blank"
    for number, colour in enumerate(POINT_COLOURS):
        near = (np.abs(pixels - np.array(colour)) <= 12).all(axis=-1).sum()
        assert near > 200, f"point {number}'s lines (colour {colour}) are not on the charts"
