"""End to end through the real entry point: `python recipes/grpo.py +experiment=smoke...`.

Real Ray, real HTTP servers on loopback, a real (tiny) model and optimizer steps. Every key the
run logs must be documented in docs/metrics.md. Each run takes minutes on two cores: the whole
module is `slow` (`python -m pytest -m slow`, which .ci/run runs after `make test`).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes.recipe_runs import read_metrics, run_recipe
from tests.support.metric_docs import documented_patterns

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    done = run_recipe(out, "+experiment=smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def test_smoke_writes_one_record_per_step_with_per_agent_truncation(smoke_run):
    records = read_metrics(smoke_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    # The parity gate checks the first step only, before its update, and it passed.
    assert ["parity/passed" in r for r in records] == [True, False, False]
    assert records[0]["parity/passed"] == 1.0
    for record in records:
        assert record["async/weight_version"] == record["step"]
        assert record["train/num_tokens"] > 0
        assert 0 < record["perf/engine_busy_share"] <= 1
        # The built-in agents send the rows' own sampling, so nothing is overridden.
        assert record["generation/sampling_overridden"] == 0
        assert record["generation/sampling_rejected"] == 0
        assert 1 <= record["perf/engine_rows_per_decode_step"] <= 16  # generation.max_batch_size
        assert record["perf/generated_tokens_per_s"] > 0
        assert record["perf/engine_tokens_per_busy_s"] > record["perf/generated_tokens_per_s"]
        # Each turn's last token is always computed, so reuse never covers every prompt token.
        assert 0 <= record["perf/engine_prefix_reuse_share"] < 1
        agents = {
            key.split("/")[1]
            for key in record
            if key.startswith("train/") and key.endswith("/reward/mean")
        } - {"reward"}
        assert agents, "no per-agent training reward metric"
        for agent in agents:
            assert record[f"train/{agent}/noncontiguous_truncated/mean"] == 0.0
    every_agent = {
        key.split("/")[1]
        for r in records
        for key in r
        if key.endswith("/noncontiguous_truncated/mean")
    }
    assert every_agent == {"calculator_agent", "guess_number_agent"}


def test_smoke_episodes_reach_several_turns(smoke_run):
    records = read_metrics(smoke_run)
    assert (
        max(
            r["train/guess_number_agent/num_turns/max"]
            for r in records
            if "train/guess_number_agent/num_turns/max" in r
        )
        >= 2
    )


def test_smoke_validates_every_second_step_and_at_the_end_on_held_out_rows(smoke_run):
    records = {r["step"]: r for r in read_metrics(smoke_run)}
    assert "validation/reward/mean" not in records[1]
    for step in (2, 3):
        record = records[step]
        assert record["validation/episodes"] + record["validation/failures"] == 8
        assert record["timing/validation_s"] > 0
        for agent in ("calculator_agent", "guess_number_agent"):
            assert 0.0 <= record[f"validation/{agent}/reward/mean"] <= 1.0
            assert record[f"validation/{agent}/noncontiguous_truncated/mean"] == 0.0
            assert f"validation/{agent}/reward/stderr" in record
    picture = smoke_run / "metrics.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_healthy_run_logs_its_stall_counters_at_zero(smoke_run):
    """docs/reliability.md, "Stalls": no prompt refused for its length, no episode attempt past
    its deadline in a run where nothing stalls; both counters are logged every step."""
    for record in read_metrics(smoke_run):
        assert record["rollout/prompt_too_long_total"] == 0.0
        assert record["rollout/episode_timeouts_total"] == 0.0


def test_every_logged_key_is_documented(smoke_run):
    patterns = documented_patterns()
    keys = {key for record in read_metrics(smoke_run) for key in record} - {"step"}
    undocumented = sorted(k for k in keys if not any(p.match(k) for p in patterns))
    assert not undocumented, f"document these in docs/metrics.md: {undocumented}"


def test_smoke_saves_checkpoints_and_resumes(smoke_run, tmp_path):
    checkpoints = sorted(p.name for p in (smoke_run / "checkpoints").iterdir())
    assert checkpoints == ["step_2"]
    done = run_recipe(smoke_run, "+experiment=smoke", "resume=true", "grpo.num_steps=4")
    assert done.returncode == 0, done.stderr[-5000:]
    assert "resumed from" in done.stdout and "at step 2" in done.stdout
    steps = [r["step"] for r in read_metrics(smoke_run)]
    assert steps == [1, 2, 3, 3, 4], "resume continues at the checkpoint's step"


def test_a_lora_smoke_run_refits_its_adapter_saves_it_in_pefts_format_and_resumes(tmp_path):
    lora = ["+experiment=smoke", "trainer.lora.enabled=true", "trainer.lora.rank=4"]
    done = run_recipe(tmp_path, *lora)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "LoRA rank 4 (alpha 32, dropout 0)" in done.stdout  # the plan
    folder = tmp_path / "checkpoints" / "step_2"
    assert (folder / "adapter_config.json").is_file()
    assert not (folder / "model.safetensors").exists()
    assert [r["async/weight_version"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]
    done = run_recipe(tmp_path, *lora, "resume=true", "grpo.num_steps=4")
    assert done.returncode == 0, done.stderr[-5000:]
    assert "resumed from" in done.stdout and "at step 2" in done.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 3, 4]


def test_noncontiguous_smoke_truncates_and_reports_a_nonzero_rate(tmp_path):
    """Agents send earlier turns back as text: the server re-tokenises and contiguity breaks."""
    done = run_recipe(tmp_path, "+experiment=smoke_noncontiguous")
    assert done.returncode == 0, done.stderr[-5000:]
    records = read_metrics(tmp_path)
    assert len(records) == 3
    rates = [
        r["train/guess_number_agent/noncontiguous_truncated/mean"]
        for r in records
        if "train/guess_number_agent/noncontiguous_truncated/mean" in r
    ]
    assert rates and max(rates) > 0.0
    assert all(0.0 <= rate <= 1.0 for rate in rates)


def test_noncontiguous_smoke_stopped_at_the_divergence_generates_no_tail(tmp_path):
    """generation.server.stop_on_divergence: the server sees the re-rendered history as the
    request arrives and answers without generating, so truncation has no tail left to drop."""
    done = run_recipe(
        tmp_path, "+experiment=smoke_noncontiguous", "generation.server.stop_on_divergence=true"
    )
    assert done.returncode == 0, done.stderr[-5000:]
    records = read_metrics(tmp_path)
    stopped = sum(r["generation/divergence_stopped"] for r in records)
    assert stopped > 0
    assert stopped == sum(r["generation/divergence_detected"] for r in records)
    assert all(r["ledger/untrained_tokens/dropped_tail"] == 0 for r in records)
    for field in ("noncontiguous_stopped", "noncontiguous_withheld"):
        shares = [
            value
            for r in records
            for key, value in r.items()
            if key.startswith("train/") and key.endswith(f"/{field}/mean")
        ]
        assert shares and max(shares) > 0.0, field
    patterns = documented_patterns()
    keys = {key for record in records for key in record} - {"step"}
    assert not [k for k in keys if not any(p.match(k) for p in patterns)]


def test_noncontiguous_smoke_without_truncation_fails_fast_with_the_contiguity_error(tmp_path):
    done = run_recipe(
        tmp_path,
        "+experiment=smoke_noncontiguous",
        "env.nemo_gym.truncate_noncontiguous_episodes=false",
        timeout=180,
    )
    assert done.returncode == 1
    assert "run stopped: NonContiguousEpisodeError: non-contiguous episode" in done.stderr
    assert "first difference at token" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_ablation_multirun_runs_one_job_per_setting(tmp_path):
    """`-m +experiment=truncation_ablation`: one job per honor_prompt_token_ids value, each with
    its own output folder and metrics (shrunk to the tiny model and one step here)."""
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "-m",
            "+experiment=truncation_ablation",
            "policy=tiny_llama",
            "grpo.num_steps=1",
            "generation.server.max_tokens_per_turn=16",
            "logger.progress_bar=false",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    for job, honor in (("0", "True"), ("1", "False")):
        overrides = (tmp_path / job / ".hydra" / "overrides.yaml").read_text()
        assert f"generation.server.honor_prompt_token_ids={honor}" in overrides
        (record,) = read_metrics(tmp_path / job)
        assert record["step"] == 1
        # One step trains the groups that finished first: either agent's, or both.
        agents = {key.split("/")[1] for key in record if key.endswith("/reward/mean")} - {"reward"}
        assert agents and agents <= {"calculator_agent", "guess_number_agent"}
        for agent in agents:
            assert f"train/{agent}/noncontiguous_truncated/mean" in record
