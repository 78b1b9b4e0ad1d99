"""`python recipes/grpo.py +experiment=sglang_cpu_smoke trainer.lora.enabled=true`: the torch
trainer trains a LoRA adapter and every refit moves the adapter alone into the real SGLang
server on this CPU (`SGLangEngine.update_adapter`): loaded from tensors as `policy_v<step>`,
checksummed by the server, named by every request after it, the versions past the window
unloaded; the checkpoint holds the adapter in PEFT's format.

Marked `slow` and `sglang_cpu`, as the full-weight smoke run beside it."""

import math

import pytest

from gymrl.run.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from tests.recipes.recipe_runs import read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.sglang_cpu]


def test_a_lora_run_refits_its_adapter_into_the_real_server_every_step(tmp_path):
    done = run_recipe(
        tmp_path,
        "+experiment=sglang_cpu_smoke",
        "trainer.lora.enabled=true",
        "trainer.lora.rank=8",
        "trainer.optimizer.lr=1e-4",
        "grpo.num_steps=3",
        "checkpoint.every_n_steps=3",
        "logger.wandb.mode=disabled",
        timeout=1500,
        this_checkout_first=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "adapter refits loaded from tensors as policy_v<step>" in done.stdout  # the plan
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[0]["parity/passed"] == 1  # the server's log-probs (base + adapter 0)
    for record in records:
        assert record["async/weight_version"] == record["step"]  # an adapter refit every step
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0
    log = (tmp_path / "logs" / "sglang_engine_0.log").read_text()
    loaded = [f"policy_v{version}" for version in range(4)]  # the start's, then each step's
    for name in loaded:
        assert f"Lora name={name}" in log, name
    # grpo's default max trajectory age 1: two versions kept, the older ones unloaded.
    for name in loaded[:2]:
        assert f"Start unload Lora adapter. Lora name={name}" in log, name
    assert "Start unload Lora adapter. Lora name=policy_v2" not in log
    step = tmp_path / "checkpoints" / "step_3"
    assert (step / ADAPTER_CONFIG_FILE).is_file() and (step / ADAPTER_WEIGHTS_FILE).is_file()
