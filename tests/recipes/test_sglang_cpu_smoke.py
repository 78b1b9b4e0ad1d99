"""`python recipes/grpo.py +experiment=sglang_cpu_smoke` through the real entry point: the real
SGLang server on this CPU (`make sglang-venv`), the torch trainer broadcasting its weights to it
over gloo after every step, the built-in agents, the parity gate at step 1.

Marked `slow` and `sglang_cpu`: `.ci/run` builds the venv before the slow suite.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gymrl" / "generation"))

from real_sglang import KERNEL_STANDIN, VENV  # noqa: E402  (a test helper, through sys.path)


def test_the_real_server_serves_a_training_run_refit_every_step(tmp_path):
    if not (VENV / "bin" / "python").is_file():
        pytest.fail(f"no SGLang venv at {VENV}: run `make sglang-venv` (or set SGLANG_VENV)")
    done = subprocess.run(
        [
            sys.executable,
            "recipes/grpo.py",
            "+experiment=sglang_cpu_smoke",
            f"generation.launch.python={VENV / 'bin' / 'python'}",
            f"+generation.launch.env.PYTHONPATH={KERNEL_STANDIN}",
            "logger.wandb.mode=disabled",
            f"run.output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}",
            "logger.progress_bar=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    assert records[0]["parity/passed"] == 1  # the real server's log-probs are the trainer's
    for record in records:
        assert record["async/weight_version"] == record["step"]  # refit after every step
        # The loss is 0 when every group's rewards tie (2 episodes per group of an untrained
        # model often do), so only that it was computed over trained tokens is asserted.
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0
        assert record["perf/train_tokens_per_s"] > 0
