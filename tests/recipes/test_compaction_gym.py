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


def test_episodes_are_compacted_and_trained_as_their_declared_segments(tmp_path):
    """About a third of SmolLM2's episodes call a tool, and each of those is compacted at its
    next model call (its reply), so a step of 16 episodes holds compactions (none in 16 would
    be about 0.3% likely). Truncation off, as the experiment runs: a compacted episode's
    rewritten history would stop the run were the compaction not declared; declared, each
    segment is trained, every divergence is a declared one, and no episode is truncated."""
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    done = run_recipe(tmp_path, "+experiment=compaction_gym", "grpo.num_steps=1", timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (record,) = read_metrics(tmp_path)
    assert record["rollout/episodes"] == 16 and record["rollout/failures_total"] == 0
    at = f"train/{AGENT}/"
    assert record[at + "compactions/max"] >= 1, "no episode was compacted"
    assert record[at + "compaction_segments/max"] >= 2
    assert record[at + "compaction_segment_tokens/max"] > 0
    assert record[at + "compaction_declared_share"] == 1.0
    assert record[at + "compaction_undeclared_divergences/max"] == 0
    assert record[at + "noncontiguous_truncated/mean"] == 0
    # Every generated token of the step is accounted for, the later segments' among the trained.
    ledger = "ledger/" + AGENT + "/"
    assert record[ledger + "untrained_tokens/dropped_tail"] == 0
