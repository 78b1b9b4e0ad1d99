"""`loss.*` (conf/loss/): the PPO clip, the off-policy correction of the importance ratio and
the episode rules (how an agent's episodes enter the loss and their group's baseline)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from gymrl.config.schema.base import Strict


class OffPolicyCorrectionConfig(Strict):
    """How the importance ratio `pi_trainer / pi_engine` of each generated token (against the
    log-probabilities the engine returned) is bounded before the PPO clip (gymrl.algo.loss).

    Token modes look at each token's own ratio; sequence modes at the geometric mean of the
    episode's token ratios, which then stands for every token of the episode (GSPO's token form:
    the value is the episode's, the gradient each token's)."""

    mode: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            default="token_truncate",
            description="none: no correction, the ratio is 1 (on-policy samples only; refused with "
            "grpo.async_enabled). token_truncate: each token's ratio is capped at ratio_high "
            "(truncated importance sampling; its gradient is scaled down with it). token_mask: "
            "tokens whose ratio is outside [ratio_low, ratio_high] leave the loss (ICE-POP). "
            "sequence_truncate: the episode's geometric-mean ratio, capped at ratio_high. "
            "sequence_mask: episodes whose geometric-mean ratio is outside [ratio_low, ratio_high] "
            "leave the loss. Masked tokens still count in the loss's denominator.",
        )
    )
    ratio_low: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Bottom of the kept band of the mask modes (unused by the others).",
    )
    ratio_high: float = Field(
        default=2.0,
        gt=1,
        description="Cap of the truncate modes and top of the kept band of the mask modes.",
    )


class EpisodeRulesConfig(Strict):
    """How one agent's episodes enter the loss and their group's baseline
    (gymrl.algo.episode_rules)."""

    overlong_mask: bool = Field(
        default=False,
        description="Episodes that hit a token limit (the agent's `overlong` flag or Gym's "
        "incomplete_details: max_output_tokens, kept when truncation dropped that turn) train "
        "on no token; their reward still joins the baseline as masked_in_baseline says.",
    )
    overlong_penalty_buffer_tokens: int = Field(
        default=0,
        ge=0,
        description="DAPO's soft overlong penalty: a model call that generated more than "
        "limit - buffer tokens costs its episode (tokens - (limit - buffer)) / buffer x "
        "overlong_penalty_max of reward, up to overlong_penalty_max at the limit (the episode "
        "pays for its longest call). 0 = off.",
    )
    overlong_penalty_limit_tokens: int | None = Field(
        default=None,
        gt=0,
        description="The per-call token limit the soft penalty measures against; null = "
        "generation.server.max_tokens_per_turn (the policy server's default limit).",
    )
    overlong_penalty_max: float = Field(
        default=1.0, gt=0, description="Reward an episode loses at the limit."
    )
    masked_in_baseline: bool = Field(
        default=True,
        description="Masked episodes (on_malformed_result=mask, overlong_mask) count in their "
        "group's mean and standard deviation with their reward; false leaves them out.",
    )
    failed_reward: float | None = Field(
        default=None,
        description="Episodes that failed after their retries (an infrastructure failure: no "
        "result): null leaves them out of their group's baseline; a number counts each as a "
        "masked episode with this reward in the group's mean and standard deviation.",
    )


class LossConfig(Strict):
    clip_ratio_low: float = Field(default=0.2, ge=0, description="PPO clip below 1.")
    clip_ratio_high: float = Field(default=0.28, ge=0, description="PPO clip above 1 (DAPO).")
    kl_coef: float = Field(default=0.0, ge=0, description="Weight of the k3 KL to the reference.")
    off_policy_correction: OffPolicyCorrectionConfig = Field(
        default_factory=OffPolicyCorrectionConfig
    )
    token_level_normalization: bool = Field(
        default=True,
        description="Average the loss over all generated tokens of the batch (true) or per "
        "sequence first (false).",
    )
    normalize_advantages_by_std: bool = Field(
        default=True, description="Divide group-centred rewards by the group's std."
    )
    episodes: EpisodeRulesConfig = Field(
        default_factory=EpisodeRulesConfig, description="Episode rules of every agent."
    )
    episodes_per_agent: dict[str, EpisodeRulesConfig] = Field(
        default_factory=dict,
        description="Per agent name, the fields that differ from loss.episodes for that agent "
        "(merged over it: loss.episodes_per_agent.calculator_agent.overlong_mask=true keeps "
        "every other loss.episodes field).",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_agent_rules_over_the_shared_ones(cls, data: Any) -> Any:
        """Each agent's partial rules become whole ones, merged over `episodes`, so that a
        default has one home (EpisodeRulesConfig) and an agent entry says only what differs."""
        if not isinstance(data, dict) or not isinstance(data.get("episodes_per_agent"), dict):
            return data
        shared = data.get("episodes", {})
        if isinstance(shared, BaseModel):
            shared = shared.model_dump()
        if not isinstance(shared, dict):
            return data  # the field's own validation reports it
        merged = {}
        for agent, rules in data["episodes_per_agent"].items():
            if isinstance(rules, BaseModel):
                rules = rules.model_dump(exclude_unset=True)
            merged[agent] = {**shared, **rules} if isinstance(rules, dict) else rules
        return {**data, "episodes_per_agent": merged}

    def episode_rules(self, agent: str) -> EpisodeRulesConfig:
        """The rules `agent`'s episodes follow."""
        return self.episodes_per_agent.get(agent, self.episodes)

    def whole_sequence_choices(self) -> dict[str, tuple[Any, str]]:
        """`{key: (value, fix)}` of the choices that weigh or judge each trained sequence as a
        whole (a per-sequence mean, a sequence-level importance ratio): wrong for an episode
        trained as several sequences (split mode's tail segments, declared compaction
        segments), which they would count once per sequence. Empty when the loss sees tokens."""
        choices: dict[str, tuple[Any, str]] = {}
        if not self.token_level_normalization:
            choices["loss.token_level_normalization"] = (
                False,
                "set loss.token_level_normalization=true",
            )
        mode = self.off_policy_correction.mode
        if mode.startswith("sequence_"):
            choices["loss.off_policy_correction.mode"] = (
                mode,
                "use a token mode (token_truncate or token_mask)",
            )
        return choices
