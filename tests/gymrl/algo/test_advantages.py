"""GRPO advantages on hand-computed groups, and against a per-group reference loop."""

import math

import pytest
import torch

from gymrl.algo.advantages import grpo_advantages, share_of_groups_with_variance

# Interleaved groups:
#   a: [1.0, 0.0, 0.5]  mean 0.5, centred [0.5, -0.5, 0.0], Bessel var (0.25+0.25+0)/2 = 0.25,
#      std 0.5 -> normalised [1.0, -1.0, 0.0]
#   b: [2.0]            single sample -> 0
#   c: [0.1, 0.1, 0.1]  all equal -> exactly 0 (0.3/3 != 0.1 in floating point)
#   d: [3.0, 1.0]       mean 2, centred [1, -1], var 2/1 = 2, std sqrt(2) -> [1/sqrt2, -1/sqrt2]
REWARDS = [1.0, 0.1, 3.0, 0.0, 2.0, 0.1, 0.5, 1.0, 0.1]
GROUPS = ["a", "c", "d", "a", "b", "c", "a", "d", "c"]


def test_std_normalised_advantages_by_hand():
    advantages = grpo_advantages(
        torch.tensor(REWARDS, dtype=torch.float64), GROUPS, normalize_by_std=True, eps=0.0
    )
    half = 1 / math.sqrt(2)
    expected = [1.0, 0.0, half, -1.0, 0.0, 0.0, 0.0, -half, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-12)
    assert advantages[[1, 4, 5, 8]].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_eps_enters_the_denominator():
    # Group a has std 0.5: with eps 0.5 its advantages halve.
    advantages = grpo_advantages(
        torch.tensor([1.0, 0.0, 0.5]), ["a"] * 3, normalize_by_std=True, eps=0.5
    )
    assert advantages.tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_mean_only_advantages_by_hand():
    advantages = grpo_advantages(torch.tensor(REWARDS), GROUPS, normalize_by_std=False, eps=1e-6)
    expected = [0.5, 0.0, 1.0, -0.5, 0.0, 0.0, 0.0, -1.0, 0.0]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert advantages.dtype == torch.float32


def test_integer_rewards_give_float32():
    advantages = grpo_advantages(torch.tensor([1, 0]), ["g", "g"], normalize_by_std=False, eps=0.0)
    assert advantages.dtype == torch.float32
    assert advantages.tolist() == [0.5, -0.5]


def test_matches_a_per_group_reference():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(60, generator=generator, dtype=torch.float64)
    groups = [f"task{int(i)}" for i in torch.randint(0, 9, (60,), generator=generator)]
    advantages = grpo_advantages(rewards, groups, normalize_by_std=True, eps=1e-4)
    for name in set(groups):
        members = [i for i, g in enumerate(groups) if g == name]
        values = rewards[members]
        if len(members) == 1:
            expected = torch.zeros(1, dtype=torch.float64)
        else:
            expected = (values - values.mean()) / (values.std() + 1e-4)
        assert advantages[members].tolist() == pytest.approx(expected.tolist(), abs=1e-12)


def test_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_ids has 1 entries but rewards has 2"):
        grpo_advantages(torch.zeros(2), ["g"], normalize_by_std=True, eps=1e-6)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), ["g"] * 4, normalize_by_std=True, eps=1e-6)


def test_share_of_groups_with_variance_counts_the_groups_that_have_a_learning_signal():
    rewards = [0.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.25]
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    assert share_of_groups_with_variance(rewards, groups) == 0.25  # only b: d has one sample
    advantages = grpo_advantages(torch.tensor(rewards), groups, normalize_by_std=True, eps=1e-6)
    nonzero_groups = {g for g, a in zip(groups, advantages.tolist(), strict=True) if a != 0}
    assert nonzero_groups == {"b"}
    with pytest.raises(ValueError, match="empty"):
        share_of_groups_with_variance([], [])
