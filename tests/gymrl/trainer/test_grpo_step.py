"""The step plumbing both trainers share: the step's loss denominator, the one `grpo_loss` call
with the configured loss, and the reduction of micro-batch metrics."""

import math

import pytest
import torch

from gymrl.algo.loss import grpo_loss
from gymrl.algo.trajectory import Trajectory, collate
from gymrl.config.schema.loss import LossConfig, OffPolicyCorrectionConfig
from gymrl.trainer.grpo_step import loss_normalizer, micro_batch_loss, reduce_loss_metrics
from tests.gymrl.trainer.fixed_trajectories import fixed_trajectory


def test_loss_normalizer_counts_tokens_or_sequences():
    masked = Trajectory([], [], [], 0.0, "a", "g", 0)
    trajectories = [fixed_trajectory(2, 3), fixed_trajectory(4, 0), fixed_trajectory(1, 2), masked]
    assert loss_normalizer(trajectories, token_level=True) == 5.0
    assert loss_normalizer(trajectories, token_level=False) == 2.0


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batch_loss_passes_every_loss_setting_and_the_step_normalizer(token_level):
    loss = LossConfig(
        clip_ratio_low=0.1,
        clip_ratio_high=0.3,
        kl_coef=0.05,
        off_policy_correction=OffPolicyCorrectionConfig(ratio_high=1.5),
        token_level_normalization=token_level,
    )
    batch = collate(
        [fixed_trajectory(2, 3), fixed_trajectory(1, 2)],
        advantages=torch.tensor([1.0, -1.0]),
        pad_token_id=0,
    )
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(batch["input_ids"].shape, generator=generator)
    reference = -torch.rand(batch["input_ids"].shape, generator=generator)
    got, metrics = micro_batch_loss(
        logprobs, batch, loss, normalizer=7.0, agents=["a", "b"], reference_logprobs=reference
    )
    expected, expected_metrics = grpo_loss(
        logprobs,
        batch["generation_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        reference_logprobs=reference,
        clip_ratio_low=0.1,
        clip_ratio_high=0.3,
        kl_coef=0.05,
        off_policy=OffPolicyCorrectionConfig(ratio_high=1.5),
        token_level_normalization=token_level,
        normalizer=7.0,
        agents=["a", "b"],
    )
    assert torch.equal(got, expected) and metrics == expected_metrics
    assert metrics["kl"] > 0


def test_reduce_loss_metrics_sums_losses_weights_means_and_ignores_fillers():
    base = {"loss": 0.25, "pg_loss": 0.25, "kl": 0.0, "clip_fraction": 0.5}
    first = base | {
        "importance_ratio/mean": 1.2,
        "importance_ratio/max": 0.9,
        "approx_entropy": 2.0,
        "mismatch/k3_kl": 0.004,
        "mismatch/large_delta_share": 0.0,
        "num_tokens": 3.0,
    }
    second = base | {
        "clip_fraction": 0.0,
        "importance_ratio/mean": 0.8,
        "importance_ratio/max": 0.95,
        "approx_entropy": 1.0,
        "mismatch/k3_kl": 0.008,
        "mismatch/large_delta_share": 1.0,
        "num_tokens": 1.0,
    }
    filler = {key: 0.0 for key in first} | {
        "importance_ratio/max": 1.0,
        "importance_ratio/mean": 1.0,
    }
    merged = reduce_loss_metrics([first, second, filler])
    assert merged["loss"] == 0.5 and merged["num_tokens"] == 4.0
    assert math.isclose(merged["clip_fraction"], 0.375)
    assert math.isclose(merged["importance_ratio/mean"], 1.1)
    assert math.isclose(merged["approx_entropy"], 1.75)
    assert math.isclose(merged["mismatch/k3_kl"], 0.005)  # weighted by tokens, as the means
    assert math.isclose(merged["mismatch/large_delta_share"], 0.25)
    assert merged["importance_ratio/max"] == 0.95
    with pytest.raises(ValueError, match="no metrics"):
        reduce_loss_metrics([])
