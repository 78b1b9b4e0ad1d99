"""`python recipes/grpo.py +experiment=flagship_cpu` as written (no override but the run's
folder), through the real entry point: the flagship's code path on this CPU, on its model family
in miniature (the tiny Qwen3-MoE). The real SGLang server at TP 2 / EP 2 (`make sglang-venv`),
the Megatron trainer as two expert-parallel Ray actors in their own venv (`make megatron-venv`,
`cluster.roles.trainer.python`) whose worker processes the CPU device shim prepares
(`cluster.roles.trainer.setup_hook`, found through `python_path`), a NeMo-Gym deployment launched
from Gym's venv (`make gym-venv`), async GRPO with truncation on, a broadcast refit of every
expert after every step, the first checked on the server by the weights checker (every tensor
randomised, then compared after the refit: a tensor the refit did not write stops the run), and a
Megatron checkpoint at the last.

The driver is the CPU role's Python (this process's); marked `slow`, `megatron` and `sglang_cpu`
for the three venvs: `.ci/run` runs it after `make megatron-venv` with
`python -m pytest -m 'slow and megatron'`.
"""

import math

import pytest
import torch

from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.megatron, pytest.mark.sglang_cpu]


def test_the_flagships_code_path_trains_three_steps_on_this_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip(
            "flagship_cpu is the CPU form: its SGLang server runs on the CPU and cannot join the "
            "NCCL group a Megatron rank on CUDA broadcasts over (on GPUs, run the flagship)"
        )
    # A venv `make` has not made stops the run at once, naming its target. This checkout's
    # code, whichever checkout the editable install points at (Ray's workers inherit it).
    done = run_recipe(
        tmp_path,
        "+experiment=flagship_cpu",
        "logger.wandb.mode=disabled",
        timeout=2400,
        this_checkout_first=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    plan = done.stdout
    assert "MoE" in plan and "EP 2" in plan  # the tiny MoE, both sides expert-parallel
    assert "refit over nccl, checked by weights_checker" in plan
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[0]["parity/passed"] == 1  # the real server's log-probs are Megatron's
    for record in records:
        assert record["async/weight_version"] == record["step"]  # a broadcast after every step
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0
        assert math.isfinite(record["train/grad_norm"])
        assert record["timing/refit_s"] > 0
        # The signature metric, per agent of the step's groups (truncation is on).
        truncated = {
            key: value
            for key, value in record.items()
            if key.startswith("train/") and key.endswith("/noncontiguous_truncated/mean")
        }
        assert truncated and all(0 <= value <= 1 for value in truncated.values()), record
    checkpoint = tmp_path / "checkpoints" / "step_3"
    assert (checkpoint / "COMPLETE").is_file() and (checkpoint / "megatron").is_dir()
