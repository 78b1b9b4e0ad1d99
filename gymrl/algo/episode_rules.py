"""Episode rules: how each agent's episodes enter a GRPO step (`loss.episodes`, merged per agent
with `loss.episodes_per_agent`).

Three choices a user makes per agent, because agents differ in how often they hit a token limit
and in what a failure means for them:

* an episode that hit a token limit (`Trajectory.overlong`) may train on nothing, since its
  reward judges an answer the model never finished (DAPO's overlong filtering);
* a soft penalty (DAPO's overlong reward shaping) may take reward from episodes whose longest
  model call came within `overlong_penalty_buffer_tokens` of the limit, rising linearly to
  `overlong_penalty_max` at the limit, so the policy learns to stop before the cut instead of
  being judged at random by it;
* masked episodes may or may not count in their group's baseline, and episodes that failed for
  want of infrastructure (no result after retries) may count with a stated reward.

The penalty changes only the reward the advantage is computed from (`Trajectory.length_penalty`);
the environment's reward stays what metrics report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gymrl.algo.advantages import grpo_advantages
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import EpisodeRulesConfig, LossConfig

ADVANTAGE_EPS = 1e-6


def overlong_penalty(turn_lengths: Sequence[int], rules: EpisodeRulesConfig, limit: int) -> float:
    """DAPO's soft overlong penalty of an episode, from its longest model call: 0 up to
    `limit - buffer` generated tokens, then rising linearly to `overlong_penalty_max` at `limit`
    (and staying there past it). 0 when the buffer is 0 (off)."""
    buffer = rules.overlong_penalty_buffer_tokens
    if buffer == 0:
        return 0.0
    if buffer >= limit:
        raise ValueError(
            f"overlong_penalty_buffer_tokens={buffer} must be below the token limit {limit} it "
            "counts back from; lower the buffer or raise overlong_penalty_limit_tokens"
        )
    longest = max(turn_lengths, default=0)
    share = (longest - (limit - buffer)) / buffer
    return rules.overlong_penalty_max * min(max(share, 0.0), 1.0)


@dataclass(frozen=True)
class EpisodeRules:
    """The loss config's episode rules, applied: `default_limit_tokens` is the per-call limit
    the soft penalty measures against where an agent's rules name none (the policy server's
    `max_tokens_per_turn`)."""

    loss: LossConfig
    default_limit_tokens: int

    def shape(self, trajectory: Trajectory) -> Trajectory:
        """`trajectory` as its agent's rules let it into a step: its length penalty set and,
        with `overlong_mask`, its tokens dropped if it hit a limit (a masked episode)."""
        rules = self.loss.episode_rules(trajectory.agent)
        limit = rules.overlong_penalty_limit_tokens or self.default_limit_tokens
        calls = (*trajectory.turn_lengths, trajectory.longest_call_tokens)
        penalty = overlong_penalty(calls, rules, limit)
        if rules.overlong_mask and trajectory.overlong:
            return dataclasses.replace(
                trajectory,
                token_ids=[],
                loss_mask=[],
                generation_logprobs=[],
                turn_lengths=(),
                length_penalty=penalty,
            )
        return dataclasses.replace(trajectory, length_penalty=penalty)

    def advantages(
        self, trajectories: Sequence[Trajectory], failed_by_group: Mapping[str, int]
    ) -> torch.Tensor:
        """GRPO advantages of `trajectories` (whole groups), one per trajectory.

        Each group's baseline holds its episodes' training rewards, without its masked episodes
        where the agent's `masked_in_baseline` is false, and with one `failed_reward` per
        failed episode (`failed_by_group[group_id]`) where the agent names one. An episode
        outside its baseline gets advantage 0 (it trains on nothing anyway). A tail segment
        (`Trajectory.segment > 0`) follows its episode's trajectory: it gets that advantage and
        adds nothing to the baseline, which counts each episode once.
        """
        rewards: list[float] = []
        group_ids: list[str] = []
        members: list[int] = []  # index into `trajectories` of each baseline entry, -1 = failed
        placed: set[str] = set()
        followers: list[tuple[int, int]] = []  # (segment's index, its episode's index)
        episode = -1
        for index, trajectory in enumerate(trajectories):
            if trajectory.segment:
                followers.append((index, episode))
                continue
            episode = index
            rules = self.loss.episode_rules(trajectory.agent)
            if trajectory.group_id not in placed and rules.failed_reward is not None:
                placed.add(trajectory.group_id)
                failed = failed_by_group.get(trajectory.group_id, 0)
                rewards += [rules.failed_reward] * failed
                group_ids += [trajectory.group_id] * failed
                members += [-1] * failed
            if trajectory.is_masked and not rules.masked_in_baseline:
                continue
            rewards.append(trajectory.training_reward)
            group_ids.append(trajectory.group_id)
            members.append(index)
        advantages = torch.zeros(len(trajectories), dtype=torch.float32)
        if not rewards:
            return advantages
        found = grpo_advantages(
            torch.tensor(rewards, dtype=torch.float32),
            group_ids,
            normalize_by_std=self.loss.normalize_advantages_by_std,
            eps=ADVANTAGE_EPS,
        )
        for entry, index in enumerate(members):
            if index >= 0:
                advantages[index] = found[entry]
        for index, head in followers:
            advantages[index] = advantages[head]
        return advantages

    def teaches_nothing(self, group: Sequence[Trajectory], failed: int) -> bool:
        """Whether one group would give every episode it trains on an advantage of 0 (its
        baseline holds one reward only): dynamic sampling drops such groups."""
        if not group:
            return True
        advantages = self.advantages(group, {group[0].group_id: failed})
        return all(
            advantage == 0.0
            for advantage, trajectory in zip(advantages.tolist(), group, strict=True)
            if not trajectory.is_masked
        )
