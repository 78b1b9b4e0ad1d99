"""`+experiment=gym_example` through the real entry point: the embedded model trained against
NeMo-Gym's own example environments (stock simple_agent and vllm_model servers, launched from
Gym's venv). Needs `.venv-gym` (`make gym-venv`, which .ci/run runs before the slow suite) and
several minutes on two cores: `slow`."""

from pathlib import Path

import pytest
from test_smoke_run import documented_patterns, read_metrics, run_recipe

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
