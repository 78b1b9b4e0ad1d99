"""What every trainer does the same way in one GRPO optimizer step, whatever runs the model.

One optimizer step is split into micro-batches (and, under Megatron, data-parallel ranks). For the
summed gradients to equal the full-batch gradient, every micro-batch's loss is divided by the
whole step's denominator (:func:`loss_normalizer`), not its own; :func:`micro_batch_loss` is the
one place `grpo_loss` is called with the configured loss; :func:`reduce_loss_metrics` turns the
micro-batches' (or ranks') metrics back into the step's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gymrl.algo.loss import (
    AGENT_STATISTICS_PREFIX,
    finish_agent_statistics,
    grpo_loss,
    merge_agent_statistics,
)
from gymrl.algo.trajectory import Trajectory
from gymrl.config.schema.loss import LossConfig


def loss_normalizer(trajectories: Sequence[Trajectory], token_level: bool) -> float:
    """Denominator of the whole step's loss: generated tokens, or sequences that have any."""
    if token_level:
        return float(sum(t.num_generated_tokens for t in trajectories))
    return float(sum(1 for t in trajectories if t.num_generated_tokens > 0))


def micro_batch_loss(
    logprobs: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    loss: LossConfig,
    *,
    normalizer: float,
    agents: Sequence[str],
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's GRPO loss, and its metrics.

    `batch` is a `gymrl.algo.trajectory.collate` batch (its `generation_logprobs`, `advantages`
    and `loss_mask`); `logprobs` the current policy's, aligned with it; `agents` the agent of
    each row (for the per-agent trainer-engine figures). `reference_logprobs` is needed only
    with a KL term.
    """
    return grpo_loss(
        logprobs,
        batch["generation_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        reference_logprobs=reference_logprobs,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
        kl_coef=loss.kl_coef,
        off_policy=loss.off_policy_correction,
        token_level_normalization=loss.token_level_normalization,
        normalizer=normalizer,
        agents=agents,
    )


# Losses were computed with the step's normaliser, so they add up across micro-batches; means
# over tokens are weighted by token counts; the maximum ratio is the maximum.
_SUMMED = ("loss", "pg_loss", "kl", "num_tokens")
_TOKEN_WEIGHTED = (
    "clip_fraction",
    "importance_ratio/mean",
    "approx_entropy",
    "mismatch/k3_kl",
    "mismatch/large_delta_share",
)


def reduce_loss_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Combine `grpo_loss` metrics of micro-batches (or of ranks) into the step's; the per-agent
    totals stay totals (:func:`agent_off_policy_metrics` turns them into figures), so the
    result can be combined again (a rank's micro-batches, then the ranks)."""
    if not metrics:
        raise ValueError("no metrics to reduce (no rank or micro-batch reported any)")
    tokens = sum(m["num_tokens"] for m in metrics)
    out = merge_agent_statistics(metrics)
    out.update({key: float(sum(m[key] for m in metrics)) for key in _SUMMED})
    for key in _TOKEN_WEIGHTED:
        weighted = sum(m[key] * m["num_tokens"] for m in metrics)
        out[key] = weighted / tokens if tokens else 0.0
    # Filler micro-batches (no tokens) report a neutral 1.0, which must not mask a lower maximum.
    with_tokens = [m["importance_ratio/max"] for m in metrics if m["num_tokens"] > 0]
    out["importance_ratio/max"] = max(with_tokens, default=1.0)
    return out


def agent_off_policy_metrics(
    train_metrics: Mapping[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Split a step's trainer metrics into its own and, per agent, the trainer-engine figures
    of its generated tokens as `<agent>/off_policy/<figure>` (docs/metrics.md)."""
    own = {k: v for k, v in train_metrics.items() if not k.startswith(AGENT_STATISTICS_PREFIX)}
    per_agent = {
        f"{agent}/off_policy/{name}": value
        for agent, figures in finish_agent_statistics(train_metrics).items()
        for name, value in figures.items()
    }
    return own, per_agent
