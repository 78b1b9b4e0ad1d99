"""`+experiment=gym_example` through the real entry point: the embedded model trained against
NeMo-Gym's own example environments (stock simple_agent and vllm_model servers, launched from
Gym's venv). Needs `.venv-gym` (`make gym-venv`, which .ci/run runs before the slow suite) and
several minutes on two cores: `slow`."""

import json
import re
from pathlib import Path

import pytest

from tests.recipes.recipe_runs import read_metrics, run_recipe
from tests.support.metric_docs import documented_patterns

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("example_multi_step_simple_agent", "example_single_tool_call_simple_agent")


def test_gym_example_trains_on_both_gym_agents(tmp_path):
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    # Sync: the one step trains exactly the step's two rows (one per agent, in file order); async
    # would train whichever groups finish first, often only the single-tool-call agent's.
    done = run_recipe(
        tmp_path,
        "+experiment=gym_example",
        "grpo.num_steps=1",
        "grpo.async_enabled=false",
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (record,) = read_metrics(tmp_path)
    for agent in AGENTS:
        assert f"train/{agent}/reward/mean" in record
    patterns = documented_patterns()
    undocumented = [key for key in record if not any(p.match(key) for p in patterns)]
    assert undocumented == ["step"]  # the record's index, not a metric
    assert (tmp_path / "policy_server.json").stat().st_mode & 0o077 == 0
    assert _processes_mentioning(str(tmp_path / "gym")) == [], "Gym outlived the run"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        if text in command:
            found.append(command)
    return found


def test_a_gym_row_longer_than_the_context_is_named_counted_and_skipped(tmp_path):
    """Gym's own example_multi_step row (a system prompt of about 3,400 tokens as SmolLM2's
    template renders it, against its 2,048-token context) first, then the example rows: the
    run names the row, its agent, its prompt tokens and the context, counts it, skips it and
    trains on the others, instead of stopping with a result without token ids (what the
    vllm_model adapter makes of the policy server's 400) or failing it after every retry."""
    if not (ROOT / ".venv-gym" / "bin" / "ng_run").is_file():
        pytest.fail("NeMo-Gym's venv is missing: run `make gym-venv` first")
    (gym_rows,) = (ROOT / ".venv-gym" / "lib").glob("python3*/site-packages/resources_servers")
    (long_row,) = [
        json.loads(line)
        for line in (gym_rows / "example_multi_step/data/example.jsonl").read_text().splitlines()
    ][:1]
    long_row |= {"id": "gym-multi-step-0", "agent_ref": {"name": AGENTS[0]}}
    data = tmp_path / "rows.jsonl"
    ours = (ROOT / "data/gym_example/train.jsonl").read_text()
    data.write_text(json.dumps(long_row) + "\n" + ours)
    out = tmp_path / "run"
    done = run_recipe(
        out,
        "+experiment=gym_example",
        "grpo.num_steps=1",
        "grpo.async_enabled=false",
        f"env.data.train_jsonl={data}",
        timeout=1500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    (record,) = read_metrics(out)
    # Counted once and not as a failure (other rows' episodes may fail: the example
    # environment cannot always verify what the 135M model answers).
    assert record["rollout/prompt_too_long_total"] == 1.0
    log = (out / "grpo.log").read_text()
    assert re.search(
        rf"skipping row 0 for the rest of the run: row 'gym-multi-step-0' \(agent '{AGENTS[0]}'\):"
        r" its prompt is \d{4} tokens, no fewer than the policy server's context of 2048 tokens",
        log,
    ), log[-3000:]
