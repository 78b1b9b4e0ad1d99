"""Episode rules by hand: the soft overlong penalty's shape, the overlong mask, and which
episodes count in their group's baseline (masked ones, failed ones) per agent."""

import pytest
import torch

from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.episode_rules import ADVANTAGE_EPS, EpisodeRules, overlong_penalty
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig


def _episode(reward, *, agent="a", group="g", generated=1, overlong=False, masked=False):
    tokens = [] if masked else [1, *([2] * generated)]
    return Trajectory(
        token_ids=tokens,
        loss_mask=[] if masked else [0, *([1] * generated)],
        generation_logprobs=[0.0] * len(tokens),
        reward=reward,
        agent=agent,
        group_id=group,
        weight_version=0,
        overlong=overlong,
        turn_lengths=() if masked else (generated,),
    )


@pytest.mark.parametrize(
    ("longest", "expected"),
    [(0, 0.0), (12, 0.0), (13, 0.25), (14, 0.5), (16, 1.0), (40, 1.0)],
)
def test_the_soft_penalty_rises_linearly_over_the_buffer_before_the_limit(longest, expected):
    rules = EpisodeRulesConfig(overlong_penalty_buffer_tokens=4, overlong_penalty_max=1.0)
    assert overlong_penalty([3, longest], rules, limit=16) == pytest.approx(expected)


def test_the_penalty_is_off_by_default_and_a_buffer_past_the_limit_is_named():
    assert overlong_penalty([1000], EpisodeRulesConfig(), limit=16) == 0.0
    with pytest.raises(ValueError, match="overlong_penalty_buffer_tokens=16 must be below"):
        overlong_penalty([1], EpisodeRulesConfig(overlong_penalty_buffer_tokens=16), limit=16)


def test_shape_penalises_and_masks_only_the_agent_whose_rules_say_so():
    loss = LossConfig(
        episodes=EpisodeRulesConfig(overlong_penalty_buffer_tokens=2),
        episodes_per_agent={"strict": {"overlong_mask": True}},
    )
    rules = EpisodeRules(loss, default_limit_tokens=4)
    assert loss.episode_rules("strict").overlong_penalty_buffer_tokens == 2  # merged over
    lenient = rules.shape(_episode(1.0, agent="lenient", generated=4, overlong=True))
    strict = rules.shape(_episode(1.0, agent="strict", generated=3, overlong=True))
    assert not lenient.is_masked and lenient.length_penalty == 1.0
    assert lenient.training_reward == 0.0 and lenient.reward == 1.0
    assert strict.is_masked and strict.length_penalty == 0.5 and strict.overlong


def test_masked_episodes_count_in_the_baseline_unless_their_agent_says_not():
    group = [_episode(1.0), _episode(0.0), _episode(0.0, masked=True)]
    counted = EpisodeRules(LossConfig(), default_limit_tokens=8).advantages(group, {})
    expected = grpo_advantages(
        torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, normalize_by_std=True, eps=ADVANTAGE_EPS
    )
    torch.testing.assert_close(counted[:2], expected[:2])
    loss = LossConfig(episodes=EpisodeRulesConfig(masked_in_baseline=False))
    left_out = EpisodeRules(loss, default_limit_tokens=8).advantages(group, {})
    # Baseline of {1, 0}: mean 0.5, std 0.707 -> +-0.707; the masked episode gets 0.
    torch.testing.assert_close(left_out, torch.tensor([0.7071, -0.7071, 0.0]), atol=1e-4, rtol=0)


def test_failed_episodes_join_the_baseline_with_their_stated_reward_per_agent():
    group = [_episode(1.0, agent="x"), _episode(1.0, agent="x")]
    other = [_episode(1.0, agent="y", group="h"), _episode(1.0, agent="y", group="h")]
    loss = LossConfig(episodes_per_agent={"x": {"failed_reward": 0.0}})
    advantages = EpisodeRules(loss, default_limit_tokens=8).advantages(
        group + other, {"g": 2, "h": 2}
    )
    # x: baseline {1, 1, 0, 0} -> mean 0.5, std 0.577: +0.866 each; y leaves its failures out.
    torch.testing.assert_close(
        advantages, torch.tensor([0.866, 0.866, 0.0, 0.0]), atol=1e-3, rtol=0
    )


def test_teaches_nothing_sees_the_baseline_not_only_the_rewards():
    rules = EpisodeRules(LossConfig(), default_limit_tokens=8)
    assert rules.teaches_nothing([_episode(1.0), _episode(1.0)], failed=0)
    assert not rules.teaches_nothing([_episode(1.0), _episode(0.0)], failed=0)
    failing = EpisodeRules(
        LossConfig(episodes=EpisodeRulesConfig(failed_reward=0.0)), default_limit_tokens=8
    )
    assert not failing.teaches_nothing([_episode(1.0), _episode(1.0)], failed=1)
