"""`benchmarks/bench_learn_matrix.py` without its hours of runs: every variant composes into a
valid config, and the figures come out of recorded metrics as the table says (the rise against
the one start pass, training minutes without validation, seeds that rose per agent)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from gymrl.config.compose import compose_raw
from gymrl.preflight.validate import validate_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learn_matrix.py"
AGENTS = ("calculator_agent", "guess_number_agent")


@pytest.fixture()
def bench(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_learn_matrix", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUTPUTS", tmp_path)
    return module


@pytest.mark.parametrize("variant", ["sync_ds_off", "sync_ds_on", "async_sequence_mask"])
def test_each_variant_is_a_valid_config_of_the_learn_experiment(bench, variant):
    overrides = [*bench.COMMON_OVERRIDES, *bench.VARIANTS[variant], "grpo.val_at_start=false"]
    config = validate_config(compose_raw(overrides))
    assert config.env.data.num_builtin_val_rows_per_agent == 128
    assert (config.grpo.val_at_start, config.grpo.val_period, config.grpo.val_at_end) == (
        False,
        0,
        True,
    )
    assert config.grpo.dynamic_sampling.enabled == (variant == "sync_ds_on")
    assert config.grpo.async_enabled == variant.startswith("async")


def _validation(step, calculator, guess_number, seconds):
    return {
        "step": step,
        "timing/validation_s": seconds,
        "validation/reward/mean": (calculator + guess_number) / 2,
        "validation/calculator_agent/reward/mean": calculator,
        "validation/calculator_agent/reward/stderr": 0.04,
        "validation/guess_number_agent/reward/mean": guess_number,
        "validation/guess_number_agent/reward/stderr": 0.03,
    }


def _write_run(bench, name, records, exit_s=None):
    folder = bench.OUTPUTS / name
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if exit_s is not None:
        (folder / bench.SIDECAR).write_text(json.dumps({"exit_s": exit_s, "load_average": "0"}))


def _step(step, step_s, **more):
    return {"step": step, "timing/step_s": step_s, "rollout/episodes": 16, **more}


def test_a_run_rises_against_the_start_per_minute_of_training_without_validation(bench):
    start_records = [_validation(0, 0.30, 0.40, 300.0)]
    _write_run(bench, "matrix_sync_ds_off_seed0", start_records)
    _write_run(
        bench,
        "matrix_sync_ds_on_seed0",
        [
            _step(
                1,
                60.0,
                **{
                    "train/calculator_agent/off_policy/masked_share": 0.0,
                    "train/calculator_agent/off_policy/logprob_diff/mean": 0.015,
                    "train/calculator_agent/off_policy/ratio/min": 0.8,
                    "train/calculator_agent/off_policy/ratio/max": 1.2,
                },
            ),
            _step(
                2,
                60.0,
                **{
                    "rollout/calculator_agent/uniform_dropped_total": 2,
                    "rollout/guess_number_agent/uniform_dropped_total": 1,
                    "rollout/uniform_over_budget_total": 1,
                },
            ),
            # The closing validation pass is part of the last step's wall time, not training.
            {
                **_step(3, 400.0, **{"train/calculator_agent/off_policy/ratio/max": 1.5}),
                **_validation(3, 0.50, 0.35, 340.0),
            },
        ],
        exit_s=900.0,
    )
    start_name = bench.start_run(["matrix_sync_ds_on_seed0", "matrix_sync_ds_off_seed0"])
    assert start_name == "matrix_sync_ds_off_seed0"
    start = bench.validation_passes(bench.read_metrics(start_name))[0]
    figures = bench.run_figures("matrix_sync_ds_on_seed0", start)
    assert figures["train_min"] == pytest.approx(3.0)
    assert figures["rise"] == pytest.approx(0.425 - 0.35)
    assert figures["rise_per_agent"] == pytest.approx(
        {"calculator_agent": 0.20, "guess_number_agent": -0.05}
    )
    assert figures["rise_per_train_min"] == pytest.approx(0.075 / 3.0)
    assert figures["final_overall_stderr"] == pytest.approx(math.sqrt(0.04**2 + 0.03**2) / 2)
    assert (figures["episodes"], figures["exit_s"]) == (48, 900.0)
    assert (figures["uniform_dropped"], figures["uniform_over_budget"]) == (3, 1)
    # The gate's figures are step 1's; the ratio's range is each agent's over every step.
    assert figures["parity"]["calculator_agent"]["logprob_diff/mean"] == 0.015
    assert figures["ratio_range"]["calculator_agent"] == (0.8, 1.5)
    assert all(math.isnan(v) for v in figures["ratio_range"]["guess_number_agent"])


def test_an_unfinished_run_has_no_figures(bench):
    _write_run(bench, "matrix_sync_ds_off_seed0", [_validation(0, 0.3, 0.4, 300.0)])
    _write_run(bench, "matrix_sync_ds_on_seed1", [_step(1, 60.0), _step(2, 60.0)])
    start = bench.validation_passes(bench.read_metrics("matrix_sync_ds_off_seed0"))[0]
    assert bench.run_figures("matrix_sync_ds_on_seed1", start) is None
    assert bench.run_figures("matrix_never_ran_seed0", start) is None


def test_a_variant_counts_the_seeds_that_rose_per_agent(bench):
    def run(rise, calculator, guess_number):
        per_agent = dict(zip(AGENTS, (calculator, guess_number), strict=True))
        return {
            "rise": rise,
            "rise_per_agent": per_agent,
            "final": {"overall": 0.4 + rise},
            "final_overall_stderr": 0.03,
            "train_min": 10.0,
            "rise_per_train_min": rise / 10.0,
            "episodes": 192,
            "uniform_dropped": 0,
            "masked_share": 0.0,
            "capped_share": 0.0,
        }

    summary = bench.variant_summary(
        [run(0.10, 0.15, 0.05), run(0.02, -0.04, 0.08), run(0.06, 0.01, 0.11)]
    )
    assert summary["seeds_rose"] == {"calculator_agent": 2, "guess_number_agent": 3}
    assert summary["rise"] == pytest.approx(0.06)
    assert summary["rise_seed_stderr"] == pytest.approx(0.04 / math.sqrt(3))
    assert summary["rise_row_stderr"] == pytest.approx(math.sqrt(3 * 0.03**2) / 3)
    assert summary["rise_per_train_min"] == pytest.approx(0.006)


def test_a_variant_is_paired_with_the_baseline_seed_by_seed(bench):
    def run(name, final):
        return {"run": name, "final": {"overall": final}}

    baseline = [run("matrix_sync_ds_off_seed0", 0.40), run("matrix_sync_ds_off_seed1", 0.50)]
    # Seed 2 has no baseline run to pair with, so it is left out rather than compared with
    # another seed's figure.
    other = [
        run("matrix_async_token_mask_seed1", 0.45),
        run("matrix_async_token_mask_seed0", 0.44),
        run("matrix_async_token_mask_seed2", 0.90),
    ]
    paired = bench.paired_against(baseline, other)
    assert paired["seeds"] == 2
    assert paired["differences"] == pytest.approx([-0.05, 0.04])
    assert paired["mean"] == pytest.approx(-0.005)
    assert paired["stderr"] == pytest.approx(0.045)


def test_the_start_pass_is_found_in_a_run_of_another_seed(bench):
    # A later invocation for seeds 1 and 2 must not validate at start again: the shared pass
    # sits in seed 0's run, and an unfinished folder or a run without it does not count.
    _write_run(bench, "matrix_async_token_mask_seed1", [_step(1, 60.0)])
    _write_run(bench, "matrix_sync_ds_off_seed0", [_validation(0, 0.3, 0.4, 300.0)])
    (bench.OUTPUTS / "learn_matrix").mkdir()
    assert bench.matrix_runs_on_disk() == [
        "matrix_async_token_mask_seed1",
        "matrix_sync_ds_off_seed0",
    ]
    assert bench.start_run(bench.matrix_runs_on_disk()) == "matrix_sync_ds_off_seed0"
