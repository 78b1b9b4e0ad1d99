"""The keys a step logs for issue 21's options, by name, against docs/metrics.md: per-agent
trainer-engine figures, the infrastructure failure rate, dynamic sampling's counts, the overlong
summary fields (computed from real trainer metrics and real producer counts, no Ray)."""

import torch
from metric_docs import documented_patterns

from gymrl.algo.loss import grpo_loss
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema import OffPolicyCorrectionConfig
from gymrl.experience.producer import ProducerCounts
from gymrl.experience.rollout_group import RolloutGroup
from gymrl.recipes.grpo import GRPORecipe


def _group(agent: str, rewards: list[float], failed: int) -> RolloutGroup:
    trajectories = [
        Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7], r, agent, f"{agent}-g", 0)
        for r in rewards
    ]
    summaries = [
        {"agent_ref": {"name": agent}, "reward": r, "length_penalty": 0.0, "overlong_masked": False}
        for r in rewards
    ]
    return RolloutGroup.of(trajectories, summaries, seconds=1.0, failed_episodes=failed)


def test_a_steps_new_keys_are_logged_and_documented():
    logprobs = torch.tensor([[0.0, -0.4, -0.7], [0.0, -0.5, -2.0]])
    _, train_metrics = grpo_loss(
        logprobs,
        torch.tensor([[0.0, -0.5, -0.7], [0.0, -0.5, -0.7]]),
        torch.tensor([1.0, -1.0]),
        torch.tensor([[0, 1, 1], [0, 1, 1]]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_coef=0.0,
        off_policy=OffPolicyCorrectionConfig(mode="token_mask"),
        token_level_normalization=True,
        agents=["calc", "guess"],
    )
    groups = [_group("calc", [1.0, 0.0], failed=2), _group("guess", [0.5, 0.5], failed=0)]
    counts = ProducerCounts(0, 0, 2, uniform_dropped={"guess": 3}, uniform_over_budget=1)
    metrics = GRPORecipe._metrics(0, groups, train_metrics, counts)
    assert metrics["train/calc/infra_failure_rate"] == 0.5
    assert metrics["train/guess/infra_failure_rate"] == 0.0
    assert metrics["train/guess/off_policy/masked_share"] == 0.5  # ratio e^-1.3 left the band
    assert metrics["train/calc/off_policy/logprob_diff/max"] > 0
    for key in ("ratio/mean", "ratio/std", "ratio/min", "ratio/max", "logprob_diff/mean"):
        assert f"train/calc/off_policy/{key}" in metrics
    assert metrics["train/calc/off_policy/capped_share"] == 0.0
    assert metrics["rollout/guess/uniform_dropped_total"] == 3.0
    assert metrics["rollout/uniform_over_budget_total"] == 1.0
    assert "train/calc/length_penalty/mean" in metrics
    assert "train/calc/overlong_masked/max" in metrics
    assert not [k for k in metrics if k.startswith("train/by_agent/")]  # totals stay internal
    patterns = documented_patterns()
    undocumented = [k for k in metrics if not any(p.match(k) for p in patterns)]
    assert undocumented == []
    assert any(p.match("parity/passed") for p in patterns)
