"""`benchmarks/bench_start_reward.py` runs end to end on the tiny model: two held-out rows per
agent through the evaluation path (the generation server and Gym shard roles on a local Ray,
the built-in agents, the postprocessor), and writes every agent's metrics. Nothing else in the
suite runs this benchmark, and it once rotted unnoticed when the data loader and rollout
settings it calls changed shape."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_start_reward.py"
AGENTS = ("calculator_agent", "guess_number_agent")


def test_the_bench_reports_every_agent_on_the_rows_asked_for(tmp_path):
    report = tmp_path / "start_reward.json"
    options = ["--rows", "2", "--show", "1", "--json", str(report)]
    overrides = ["policy=tiny_llama", "generation.server.max_tokens_per_turn=8"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *options, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics["eval/episodes"] == 2 * len(AGENTS)
    assert metrics["eval/failures"] == 0
    for agent in AGENTS:
        assert 0.0 <= metrics[f"eval/{agent}/reward/mean"] <= 1.0
        assert f"eval/{agent}/reward/stderr" in metrics
        assert f"--- {agent} row" in done.stdout  # one transcript each
    assert "4 rows" in done.stdout
