"""LoRA through the Megatron trainer end to end, through the real entry point on this CPU.

`+experiment=megatron_lora_cpu`: the embedded SmolLM2 trained by one Megatron rank with
megatron-bridge's LoRA (`make megatron-venv`), each refit the adapter alone into the torch
engine, a checkpoint in PEFT's format that `recipes/eval.py` and the merge command read.

`+experiment=flagship_cpu` with LoRA (attention only: an MoE's expert adapters are refused, see
docs/configuration.md "LoRA"): the same through the real SGLang server at TP 2 / EP 2, which
with each refit the adapter alone loaded into the server under its version.

Marked `slow` and `megatron` (the flagship's also `sglang_cpu`): `make test-megatron` runs them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.recipes.recipe_runs import ROOT, read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FLAGSHIP_LORA = (
    "+experiment=flagship_cpu",
    "trainer.lora.enabled=true",
    "trainer.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "trainer.optimizer.lr=1e-4",
)


def _check_lora_run(out, steps: int) -> None:
    """Every step trained and refitted the adapter (its version the step's); the last step's
    checkpoint holds PEFT's files and Megatron's adapter-only shards."""
    records = read_metrics(out)
    assert [record["step"] for record in records] == list(range(1, steps + 1))
    for record in records:
        assert record["async/weight_version"] == record["step"]
        assert math.isfinite(record["train/loss"]) and record["train/num_tokens"] > 0
        assert record["timing/refit_s"] > 0
    checkpoint = out / "checkpoints" / f"step_{steps}"
    assert (checkpoint / "COMPLETE").is_file() and (checkpoint / "megatron").is_dir()
    assert all((checkpoint / name).is_file() for name in ADAPTER_FILES)
    assert json.loads((checkpoint / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_megatron_lora_trains_refits_the_torch_engine_and_its_checkpoint_evaluates_and_merges(
    tmp_path,
):
    if torch.cuda.is_available():
        pytest.skip("megatron_lora_cpu is the CPU form (its torch engine runs on the CPU)")
    out = tmp_path / "run"
    done = run_recipe(
        out,
        "+experiment=megatron_lora_cpu",
        "logger.wandb.mode=disabled",
        timeout=2400,
        this_checkout_first=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert "base frozen, refits the adapter alone" in done.stdout
    _check_lora_run(out, 3)

    # The checkpoint evaluates and merges as a torch LoRA run's (the base: the embedded SmolLM2).
    evaluated = subprocess.run(
        [
            sys.executable,
            "recipes/eval.py",
            "+experiment=megatron_lora_cpu",
            f"eval.checkpoint={out}",
            f"eval.output_dir={tmp_path / 'eval'}",
            "eval.temperature=0",
            "eval.num_samples=1",
            "eval.pass_at_k=[1]",
            "env.data.num_builtin_val_rows_per_agent=2",
            f"run.output_dir={out}",
            f"hydra.run.dir={out}",
            "logger.wandb.mode=disabled",
            "logger.progress_bar=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    merged = subprocess.run(
        [
            sys.executable,
            "-m",
            "gymrl.recipes.merge_adapter",
            str(out),
            str(tmp_path / "merged"),
            "+experiment=megatron_lora_cpu",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.sglang_cpu
def test_the_flagships_code_path_trains_an_attention_adapter_on_this_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("flagship_cpu is the CPU form (its SGLang server runs on the CPU)")
    done = run_recipe(
        tmp_path,
        *FLAGSHIP_LORA,
        "logger.wandb.mode=disabled",
        timeout=2400,
        this_checkout_first=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert "MoE" in done.stdout and "EP 2" in done.stdout
    _check_lora_run(tmp_path, 3)
