"""A LoRA run's checkpoint without running one: the torch trainer of a composed config, its
adapter's B drawn at random (as training would move it away from zero), saved as a run saves."""

from __future__ import annotations

from pathlib import Path

import torch

from gymrl.config.compose import compose_raw
from gymrl.model.policy import build_policy
from gymrl.preflight.validate import validate_config
from gymrl.trainer.torch_trainer import TorchPolicyTrainer


def lora_trainer(overrides: list[str], *, seed: int = 0) -> TorchPolicyTrainer:
    """The torch trainer `overrides` (plus trainer.lora.enabled=true) configure, on the policy
    a run of them builds, with an adapter far from zero (B drawn from `seed`)."""
    config = validate_config(compose_raw([*overrides, "trainer.lora.enabled=true"]))
    model, _ = build_policy(config.policy, config.run.seed)
    assert config.trainer.backend == "torch"
    trainer = TorchPolicyTrainer(
        model,
        config.trainer,
        config.loss,
        temperature=1.0,
        pad_token_id=0,
        keep_last_checkpoints=1,
        compute_dtype="float32",
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return trainer


def save_lora_checkpoint(
    root: Path, overrides: list[str], step: int
) -> tuple[TorchPolicyTrainer, Path]:
    """A checkpoint of step `step` under `root` (as `<run>/checkpoints`), and its trainer."""
    trainer = lora_trainer(overrides)
    return trainer, trainer.save_checkpoint(root, step, {"position": 0})
