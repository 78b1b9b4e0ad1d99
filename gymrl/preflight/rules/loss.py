"""Rules on `loss.*` (`gymrl.config.schema.loss`) that other groups constrain: the overlong
penalty against the per-call token limit, failures counted as rewards, async GRPO's off-policy
correction."""

from __future__ import annotations

from gymrl.config.schema.loss import EpisodeRulesConfig
from gymrl.config.schema.recipe import RecipeConfig
from nemo_gym_ext.config_errors import ConfigIssue


def overlong_penalty_below_limit(config: RecipeConfig) -> list[ConfigIssue]:
    """The soft overlong penalty counts back from a limit: its buffer must fit below it."""
    issues = []
    for key, rules in _episode_rules(config).items():
        buffer = rules.overlong_penalty_buffer_tokens
        limit = rules.overlong_penalty_limit_tokens or config.generation.server.max_tokens_per_turn
        if buffer and buffer >= limit:
            issues.append(
                ConfigIssue(
                    f"{key}.overlong_penalty_buffer_tokens",
                    buffer,
                    f"the penalty's buffer must be below the per-call token limit it counts back "
                    f"from ({limit}: overlong_penalty_limit_tokens, else "
                    "generation.server.max_tokens_per_turn)",
                    f"set {key}.overlong_penalty_buffer_tokens below {limit}",
                )
            )
    return issues


def failed_reward_when_failures_are_rewards(config: RecipeConfig) -> list[ConfigIssue]:
    """Failures counted as a reward need the reward: every agent's `failed_reward`."""
    if config.env.rollout.on_episode_error != "reward":
        return []
    return [
        ConfigIssue(
            f"{key}.failed_reward",
            None,
            "env.rollout.on_episode_error=reward counts a failed episode as a reward, and this "
            "one says none",
            f"set {key}.failed_reward (e.g. 0.0) or env.rollout.on_episode_error=fail",
        )
        for key, rules in _episode_rules(config).items()
        if rules.failed_reward is None
    ]


def async_needs_off_policy_correction(config: RecipeConfig) -> list[ConfigIssue]:
    if not config.grpo.async_enabled or config.loss.off_policy_correction.mode != "none":
        return []
    return [
        ConfigIssue(
            "loss.off_policy_correction.mode",
            "none",
            "async GRPO trains on episodes sampled by older weights, which needs an "
            "off-policy correction",
            "set loss.off_policy_correction.mode=token_truncate (or another mode) or "
            "grpo.async_enabled=false",
        )
    ]


def _episode_rules(config: RecipeConfig) -> dict[str, EpisodeRulesConfig]:
    """Every agent's episode rules by the key that sets them: the default, then each override."""
    loss = config.loss
    return {"loss.episodes": loss.episodes} | {
        f"loss.episodes_per_agent.{agent}": rules
        for agent, rules in loss.episodes_per_agent.items()
    }
