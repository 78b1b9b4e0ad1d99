"""`+experiment=compaction_gym` through the real entry point: Gym's compaction agent (with this
checkout's tool-output recency policy, `gym_servers/`) behind Gym's vllm_model_with_compaction
adapter, launched from Gym's venv, calling the policy server with `required_prefix_token_ids`
and measuring prompts with its `/tokenize`. Needs `.venv-gym` (`make gym-venv`) and about five
minutes on two cores: `slow`."""

from pathlib import Path

import pytest

from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENT = "math_advanced_calculations_simple_agent"


def test_episodes_are_compacted_and_each_segment_start_is_declared(tmp_path):
    """About a third of SmolLM2's episodes call a tool, and each of those is compacted at its
    next model call (its reply), so a step of 16 episodes holds compactions (none in 16 would
    be about 0.3% likely). Truncation on: a compacted episode is non-contiguous until declared
    segments are trained, its history edited (an earlier tool output became a marker). With the
    divergence watch stopping divergences, none is detected: each compaction's first call came
    with `required_prefix_token_ids: null`, and its rewritten history was not judged."""
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    done = run_recipe(
        tmp_path,
        "+experiment=compaction_gym",
        "grpo.num_steps=1",
        "env.nemo_gym.truncate_noncontiguous_episodes=true",
        "generation.server.stop_on_divergence=true",
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (record,) = read_metrics(tmp_path)
    assert record["rollout/episodes"] == 16 and record["rollout/failures_total"] == 0
    compacted = record[f"train/{AGENT}/noncontiguous_truncated/mean"]
    assert compacted > 0, "no episode was compacted"
    assert record[f"train/{AGENT}/noncontiguous_cause/history_edited/mean"] == 1.0
    assert record["generation/divergence_detected"] == 0
    assert record["generation/divergence_stopped"] == 0
