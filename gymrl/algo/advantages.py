"""GRPO advantages: each sample's reward relative to the other samples of its group.

A group is every rollout of one task (one agent, one row). Its mean reward is the baseline, so no
value model is needed; dividing by the group's standard deviation (optional: Dr. GRPO argues it
over-weights nearly-solved and nearly-failed tasks) puts every task on one scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[str],
    *,
    normalize_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """`(r - mean_g) / (std_g + eps)` per sample, or `r - mean_g` without std normalisation.

    `std_g` is the Bessel-corrected standard deviation of the group. A group of one sample, or one
    whose rewards are all equal, carries no learning signal and gets exactly 0 (no rounding
    residue from the mean). Statistics are computed in float64 with scatter operations, so the
    cost is independent of the number of groups; the result has the dtype of `rewards` (float32
    for integer rewards). Rewards are finite: the Gym postprocessor, where every result enters the
    recipe, refuses any other, so they are not checked again here.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {list(rewards.shape)}")
    if len(group_ids) != rewards.numel():
        raise ValueError(
            f"group_ids has {len(group_ids)} entries but rewards has {rewards.numel()}; "
            "give one group id per sample"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    values = rewards.detach().to(torch.float64)
    index_of: dict[str, int] = {}
    group = torch.tensor(
        [index_of.setdefault(g, len(index_of)) for g in group_ids],
        dtype=torch.long,
        device=values.device,
    )
    num_groups = len(index_of)
    zeros = values.new_zeros(num_groups)
    count = zeros.scatter_add(0, group, torch.ones_like(values))
    mean = zeros.scatter_add(0, group, values) / count
    centered = values - mean[group]
    lowest = zeros.scatter_reduce(0, group, values, reduce="amin", include_self=False)
    highest = zeros.scatter_reduce(0, group, values, reduce="amax", include_self=False)
    informative = (count > 1) & (highest > lowest)
    if normalize_by_std:
        sum_sq = zeros.scatter_add(0, group, centered.square())
        std = (sum_sq / (count - 1).clamp(min=1)).sqrt()
        centered = centered / (std[group] + eps)
    advantages = torch.where(informative[group], centered, torch.zeros_like(centered))
    return advantages.to(out_dtype)


def share_of_groups_with_variance(rewards: Sequence[float], group_ids: Sequence[str]) -> float:
    """Share of the groups whose rewards are not all equal: only they get non-zero advantages, so
    a batch where this is 0 has a loss of exactly 0 and leaves the weights as they were."""
    by_group: dict[str, set[float]] = {}
    for reward, group in zip(rewards, group_ids, strict=True):
        by_group.setdefault(group, set()).add(reward)
    if not by_group:
        raise ValueError("no groups: the batch is empty")
    return sum(len(values) > 1 for values in by_group.values()) / len(by_group)
