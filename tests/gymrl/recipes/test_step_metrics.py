"""The keys a step logs for issue 21's options, by name, against docs/metrics.md: per-agent
trainer-engine figures, the infrastructure failure rate, dynamic sampling's counts, the overlong
summary fields (computed from real trainer metrics and real producer counts, no Ray); and issue
22's response lengths and clipped shares."""

import torch

from gymrl.algo.loss import grpo_loss
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import OffPolicyCorrectionConfig
from gymrl.experience.producer import ProducerCounts
from gymrl.experience.rollout_group import RolloutGroup
from gymrl.recipes.training import GRPORecipe
from tests.support.metric_docs import documented_patterns


def _group(agent: str, rewards: list[float], failed: int) -> RolloutGroup:
    trajectories = [
        Trajectory([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7], r, agent, f"{agent}-g", 0)
        for r in rewards
    ]
    return _group_of(trajectories, failed)


def _group_of(trajectories: list[Trajectory], failed: int = 0) -> RolloutGroup:
    agent = trajectories[0].agent
    summaries = [
        {
            "agent_ref": {"name": agent},
            "reward": t.reward,
            "length_penalty": 0.0,
            "overlong_masked": False,
        }
        for t in trajectories
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
    metrics = GRPORecipe._metrics(0, groups, train_metrics, counts, max_tokens_per_turn=64)
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


def _episode(turns: list[int], *, overlong: bool = False) -> Trajectory:
    """An episode of one prompt token then, per model call, a user token and `turns[i]`
    generated tokens."""
    mask = [0]
    for length in turns:
        mask += [0] + [1] * length
    return Trajectory(
        [5] * len(mask),
        mask,
        [0.0] * len(mask),
        1.0,
        "calc",
        "calc-g",
        0,
        overlong=overlong,
        turn_lengths=tuple(turns),
    )


def test_response_lengths_and_clipped_shares_are_logged_and_documented():
    """Three episodes: two calls (10 and the whole 64-token limit, flagged overlong), one
    call of 6, and one masked for hitting a limit (no tokens left, still clipped)."""
    masked = Trajectory([], [], [], 0.0, "calc", "calc-g", 0, overlong=True)
    group = _group_of([_episode([10, 64], overlong=True), _episode([6]), masked])
    metrics = GRPORecipe._metrics(0, [group], {}, ProducerCounts(0, 0, 0), max_tokens_per_turn=64)
    lengths = {k: v for k, v in metrics.items() if "generated_tokens/" in k}
    assert lengths == {
        "rollout/episode_generated_tokens/mean": 40.0,
        "rollout/episode_generated_tokens/min": 6.0,
        "rollout/episode_generated_tokens/max": 74.0,
        "rollout/turn_generated_tokens/mean": 80 / 3,
        "rollout/turn_generated_tokens/min": 6.0,
        "rollout/turn_generated_tokens/max": 64.0,
    }
    assert metrics["rollout/clipped_episode_share"] == 2 / 3
    assert metrics["rollout/clipped_turn_share"] == 1 / 3
    patterns = documented_patterns()
    assert [k for k in metrics if not any(p.match(k) for p in patterns)] == []
