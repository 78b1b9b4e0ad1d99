"""The table of `benchmarks/bench_vs_trl.py` from recorded figures, without installing TRL: the
bench itself needs its own virtual environment and tens of minutes, so only the arithmetic that
turns each side's records into issue 24's figures is checked here (steps 2 on, the closing
validation pass kept out of the last step, rates as sums over sums)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _project_step(step, *, step_s, wait, train, refit, tokens, train_tps, validation=None):
    record = {
        "step": step,
        "timing/step_s": step_s,
        "timing/wait_for_batch_s": wait,
        "timing/train_s": train,
        "timing/refit_s": refit,
        "rollout/episodes": 16,
        "rollout/generated_tokens": tokens,
        "perf/train_tokens_per_s": train_tps,
    }
    if validation is not None:
        record.update(
            {"timing/validation_s": validation[0], "validation/reward/mean": validation[1]}
        )
    return record


def test_project_figures_leave_out_step_one_and_the_closing_validation(bench):
    records = [
        {"step": 0, "timing/validation_s": 80.0, "validation/reward/mean": 0.25},
        {
            **_project_step(1, step_s=99.0, wait=60, train=30, refit=9, tokens=999, train_tps=1.0),
            "ledger/untrained_tokens/validation": 1000.0,  # the first pass's, a record later
        },
        _project_step(2, step_s=50.0, wait=20, train=25, refit=5, tokens=400, train_tps=200.0),
        _project_step(
            3,
            step_s=150.0,
            wait=30,
            train=25,
            refit=5,
            tokens=800,
            train_tps=300.0,
            validation=(90.0, 0.5),
        )
        | {"ledger/untrained_tokens/validation": 1040.0},
    ]
    figures = bench.project_figures(records, exit_s=400.0)
    assert figures["steps_counted"] == 2
    assert figures["step_s"] == pytest.approx(55.0)  # (50 + (150 - 90)) / 2
    assert figures["episodes_per_s"] == pytest.approx(32 / 110)
    assert figures["generated_tokens_per_rollout_s"] == pytest.approx(1200 / 50)
    assert figures["rollout_s"] == pytest.approx(25.0)
    assert figures["train_s"] == pytest.approx(25.0)
    assert figures["refit_s"] == pytest.approx(5.0)
    assert figures["trainer_tokens_per_s"] == pytest.approx((200 * 25 + 300 * 25) / 50)
    assert figures["validation_s"] == pytest.approx(170.0)
    assert figures["validation_tokens_per_s"] == pytest.approx(2040 / 170)
    assert (figures["validation_start"], figures["validation_end"]) == (0.25, 0.5)
    assert figures["exit_s"] == 400.0


def test_trl_figures_have_no_refit_and_take_both_validation_passes(bench):
    step = {"step_s": 40.0, "rollout_s": 15.0, "train_s": 25.0, "episodes": 16.0}
    result = {
        "steps": [
            {**step, "step": 1, "generated_tokens": 1.0, "trainer_tokens": 1.0},
            {**step, "step": 2, "generated_tokens": 600.0, "trainer_tokens": 5000.0},
        ],
        "validation": [
            {"wall_s": 30.0, "reward": 0.2, "generated_tokens": 600},
            {"wall_s": 35.0, "reward": 0.4, "generated_tokens": 700},
        ],
    }
    figures = bench.trl_figures(result, exit_s=200.0)
    assert figures["steps_counted"] == 1
    assert figures["refit_s"] == 0.0
    assert figures["generated_tokens_per_rollout_s"] == pytest.approx(40.0)
    assert figures["trainer_tokens_per_s"] == pytest.approx(200.0)
    assert figures["validation_s"] == pytest.approx(65.0)
    assert figures["validation_tokens_per_s"] == pytest.approx(20.0)
    assert (figures["validation_start"], figures["validation_end"]) == (0.2, 0.4)


def test_a_run_of_one_step_is_summarised_from_that_step(bench):
    figures = bench.summarise(
        [
            {
                "step": 1,
                "step_s": 10.0,
                "rollout_s": 4.0,
                "train_s": 6.0,
                "refit_s": 0.0,
                "episodes": 4.0,
                "generated_tokens": 80.0,
                "trainer_tokens": 600.0,
            }
        ]
    )
    assert figures["steps_counted"] == 1
    assert figures["episodes_per_s"] == pytest.approx(0.4)


def test_the_table_has_a_column_per_side_and_issue_24s_rows(bench):
    figures = {key: 1.0 for key, _, _ in bench.ROWS}
    table = bench.format_table({"project": figures, "trl": {**figures, "exit_s": math.nan}})
    lines = table.splitlines()
    assert lines[0] == "| figure | this project | TRL 1.16 |"
    assert len(lines) == 2 + len(bench.ROWS)
    assert lines[-1] == "| command to exit | 1 s | nan s |"


def test_the_trl_venv_takes_the_projects_pins(bench):
    pins = bench.cpu_env_pins(bench.PINNED_FROM_CPU_ENV)
    assert set(pins) == set(bench.PINNED_FROM_CPU_ENV)
    assert all(version[0].isdigit() for version in pins.values())


def test_project_rewards_are_the_training_steps_in_order(bench):
    records = [
        {"step": 0, "validation/reward/mean": 0.25},
        {"step": 2, "train/reward/mean": 0.5},
        {"step": 1, "train/reward/mean": 0.125},
        {"step": 2, "validation/reward/mean": 0.75},  # the closing pass's own record
    ]
    assert bench.project_rewards(records) == [0.125, 0.5]


def _side(rewards, start, end):
    return {
        "train_rewards": rewards,
        "figures": {"validation_start": start, "validation_end": end},
    }


def test_learning_is_averaged_over_seeds_and_paired_by_seed(bench):
    seeds = {
        "0": {"project": _side([0.0, 0.5], 0.25, 0.5), "trl": _side([0.5, 0.5], 0.25, 0.75)},
        "1": {"project": _side([0.25, 0.25], 0.5, 0.5), "trl": _side([0.25, 0.75], 0.5, 0.25)},
        "2": {"project": _side([1.0, 1.0], 0.0, 1.0)},  # TRL not run for this seed
    }
    summary = bench.learning_summary(seeds)
    assert summary["project_mean"] == pytest.approx((0.25 + 0.25 + 1.0) / 3)
    assert summary["project_stderr"] == pytest.approx(0.25)  # std 0.433 / sqrt(3)
    assert summary["trl_mean"] == pytest.approx(0.5)
    assert summary["trl_stderr"] == pytest.approx(0.0)
    # Paired over seeds 0 and 1 only: 0.5 - 0.25 both times.
    assert summary["trl_minus_project"] == pytest.approx(0.25)
    assert summary["trl_minus_project_stderr"] == pytest.approx(0.0)
    assert summary["paired_seeds"] == 2

    lines = bench.format_learning(seeds).splitlines()
    assert lines[0] == (
        "| training reward | project seed 0 | project seed 1 | project seed 2 | project mean "
        "| TRL seed 0 | TRL seed 1 | TRL seed 2 | TRL mean |"
    )
    assert lines[2] == "| step 1 | 0.000 | 0.250 | 1.000 | 0.417 | 0.500 | 0.250 | - | 0.375 |"
    assert lines[4] == (
        "| mean over steps 1-2 | 0.250 | 0.250 | 1.000 | 0.500 | 0.500 | 0.500 | - | 0.500 |"
    )
    assert (
        lines[6]
        == "| validation at the end | 0.500 | 0.500 | 1.000 | 0.667 | 0.750 | 0.250 | - | 0.500 |"
    )
    assert lines[-1].startswith("Training reward over all steps: project 0.500 (+- 0.250")


def test_trl_rewards_come_in_step_order(bench, tmp_path, monkeypatch):
    steps = [
        {
            "step": 2,
            "step_s": 1.0,
            "rollout_s": 0.5,
            "train_s": 0.5,
            "episodes": 16.0,
            "generated_tokens": 1.0,
            "trainer_tokens": 1.0,
            "reward": 0.75,
        },
        {
            "step": 1,
            "step_s": 1.0,
            "rollout_s": 0.5,
            "train_s": 0.5,
            "episodes": 16.0,
            "generated_tokens": 1.0,
            "trainer_tokens": 1.0,
            "reward": 0.25,
        },
    ]
    result = {
        "steps": steps,
        "validation": [{"wall_s": 1.0, "reward": 0.0, "generated_tokens": 1}],
        "versions": {},
        "log_history": [],
    }
    (tmp_path / "trl_result.json").write_text(json.dumps(result))
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: None)
    assert bench.run_trl(tmp_path / "spec.json", tmp_path)["train_rewards"] == [0.25, 0.75]
