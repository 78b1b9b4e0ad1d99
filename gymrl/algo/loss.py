"""The GRPO policy loss: a clipped, importance-corrected policy gradient with an optional KL term.

In async GRPO the samples come from a behaviour policy, the sampler's weights, which can be
several versions older than the trainer's, and is in any case computed by a different engine
(other kernels, other precision). The importance ratio `pi_theta / pi_behaviour` (from the
sampler's own log-probabilities) corrects for that; PPO-style clipping keeps one update from
moving a token's probability far from the behaviour policy; the off-policy correction bounds the
ratio (truncating it, or masking tokens or whole episodes whose ratio leaves a band) so that a
few tokens the sampler found very unlikely cannot dominate the gradient. Tensors follow the
alignment of `gymrl.algo.trajectory`: `[B, T]`, position `t` describing token `t`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gymrl.config.schema.loss import OffPolicyCorrectionConfig

_CHUNK_POSITIONS = 2048


def sequence_logprobs(
    model_logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-probability of each token of `input_ids` under `softmax(logits / temperature)`, `[B, T]`.

    `out[:, t]` is predicted from `model_logits[:, t - 1]`, so `out[:, 0]` is 0. The temperature
    must be the sampler's: engines report log-probabilities of the temperature-scaled
    distribution. Computed in fp32 as `logit[target] - logsumexp(logits)` over chunks of positions,
    so without autograd (behaviour or reference log-probabilities) only one chunk of fp32 logits
    exists at a time; with autograd, the backward pass keeps one fp32 copy, as any exact
    log-softmax must.
    """
    if model_logits.dim() != 3 or model_logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"model_logits must be [B, T, V] matching input_ids [B, T]; got "
            f"{list(model_logits.shape)} and {list(input_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch, length, vocab = model_logits.shape
    logits = model_logits[:, :-1].reshape(-1, vocab)
    targets = input_ids[:, 1:].reshape(-1)
    pieces = []
    for start in range(0, targets.numel(), _CHUNK_POSITIONS):
        chunk = logits[start : start + _CHUNK_POSITIONS].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        target = targets[start : start + _CHUNK_POSITIONS].unsqueeze(-1)
        picked = chunk.gather(-1, target).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    shifted = torch.cat(pieces) if pieces else logits.new_zeros(0, dtype=torch.float32)
    first = shifted.new_zeros(batch, min(length, 1))
    return torch.cat([first, shifted.view(batch, max(length - 1, 0))], dim=1)


def masked_token_logprobs(
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """`sequence_logprobs`, computed only where `loss_mask` is 1 (0 elsewhere), `[B, T]`.

    The output layer (vocabulary projection) and the log-softmax dominate a small model's step
    and are only needed at generated tokens, often a quarter of an episode: projecting just the
    hidden states that predict them (`hidden_states[:, t - 1]` for token t) saves that work.
    Same alignment and values as `sequence_logprobs(output_layer(hidden_states), ...)`.
    """
    batch, length = input_ids.shape
    rows = torch.arange(batch * length, device=input_ids.device).view(batch, length)
    return gathered_token_logprobs(
        hidden_states.flatten(0, 1), rows, output_layer, input_ids, loss_mask, temperature
    )


def gathered_token_logprobs(
    hidden_states: torch.Tensor,
    token_rows: torch.Tensor,
    output_layer: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """:func:`masked_token_logprobs` for hidden states laid out in any order: `hidden_states`
    is `[N, H]` and `token_rows[b, t]` is the row holding token `t` of sequence `b` (a padded
    batch flattened, or the nodes of a prefix tree, `gymrl.trainer.prefix_packing`). Token t is
    predicted by the row of token t - 1; result `[B, T]`, 0 where `loss_mask` is 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    predicts = torch.zeros_like(loss_mask, dtype=torch.bool)
    predicts[:, 1:] = loss_mask[:, 1:].bool()
    selected = predicts[:, 1:]
    logits = output_layer(hidden_states[token_rows[:, :-1][selected]]).float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:][selected].unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    zeros = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    return zeros.masked_scatter(predicts, picked)


def grpo_loss(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    reference_logprobs: torch.Tensor | None = None,
    clip_ratio_low: float,
    clip_ratio_high: float,
    kl_coef: float,
    off_policy: OffPolicyCorrectionConfig,
    token_level_normalization: bool,
    normalizer: float | None = None,
    agents: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss `-min(r A, clip(r, 1 - low, 1 + high) A) + kl_coef * k3`, reduced over
    the masked tokens; returns `(loss, metrics)`.

    * `r` is the importance ratio `exp(logprobs - generation_logprobs)` as `off_policy` bounds it
      (`gymrl.config.schema.loss.OffPolicyCorrectionConfig`): capped in value, its gradient scaled
      down with it, never zeroed (`*_truncate`); or kept as it is on the tokens it keeps, the
      others leaving the loss (`*_mask`; they still count in the denominator, so the kept ones
      are not re-weighted). In the sequence modes the value of `r` is the geometric mean of the
      episode's token ratios and its gradient each token's own. Mode `none`:
      `exp(logprobs - logprobs.detach())`, which is 1 with the gradient of the plain policy
      gradient (valid only when the samples are on-policy).
    * `k3 = exp(ref - logprobs) - (ref - logprobs) - 1`, an unbiased, non-negative estimate of
      KL(pi_theta || pi_ref); `reference_logprobs` is required when `kl_coef > 0`.
    * `token_level_normalization=True`: sum over every masked token / number of masked tokens
      (DAPO: long episodes weigh as much per token as short ones). False: mean per sequence, then
      mean over the sequences that have masked tokens.
    * `normalizer` overrides that denominator (token count or sequence count) when one optimizer
      step is split into micro-batches or data-parallel ranks: pass the total over all of them so
      that the summed gradients equal the full-batch gradient. `loss`, `pg_loss` and `kl` are
      then this micro-batch's share of the step's value (sum them across micro-batches).

    Masked-out positions never reach the result, even when their values are NaN or infinite.
    Metrics are floats: `loss`, `pg_loss`, `kl`, `clip_fraction` (share of tokens whose gradient
    the clip removed), `importance_ratio/mean` and `importance_ratio/max` (of the uncorrected
    token ratio), `approx_entropy` (mean negative log-probability of the sampled tokens; an
    entropy estimate when the samples are near on-policy), `mismatch/k3_kl` and
    `mismatch/large_delta_share` (the train-inference mismatch: the mean k3 estimate of
    KL(engine || trainer) and the share of tokens whose log-probabilities differ by more than
    ln 2) and `num_tokens`. With `agents` (one
    name per row), also each agent's trainer-engine statistics (:func:`agent_statistics`).
    """
    _check_shapes(logprobs, generation_logprobs, advantages, loss_mask, reference_logprobs)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and reference_logprobs is None:
        raise ValueError(
            f"kl_coef={kl_coef} needs reference_logprobs (the reference policy's log-probabilities "
            "of the batch); compute them with a reference model or set kl_coef=0"
        )
    if not 0 <= clip_ratio_low < 1 or clip_ratio_high < 0:
        raise ValueError(
            f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0; got "
            f"clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (a token or sequence count), got {normalizer}")
    if agents is not None and len(agents) != logprobs.shape[0]:
        raise ValueError(
            f"agents has {len(agents)} names for {logprobs.shape[0]} rows; one per row"
        )

    mask = loss_mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Zero the masked-out positions before any exp so that padding garbage cannot become inf/NaN.
    current = torch.where(mask, logprobs, zeros)
    engine = torch.where(mask, generation_logprobs.to(logprobs.dtype), zeros)
    correction = correct_off_policy(current, engine, mask, off_policy)
    ratio = torch.exp(correction.log_ratio)
    advantage = advantages.to(logprobs.dtype).unsqueeze(-1).expand_as(logprobs)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    kept = correction.kept
    pg_per_token = torch.where(kept, -torch.minimum(ratio * advantage, clipped * advantage), 0.0)
    per_token = pg_per_token
    kl_per_token = None
    if reference_logprobs is not None:
        log_ref_over_policy = (
            torch.where(mask, reference_logprobs.to(logprobs.dtype), zeros) - current
        )
        kl_per_token = torch.where(
            kept, torch.exp(log_ref_over_policy) - log_ref_over_policy - 1.0, 0.0
        )
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_per_token

    reduce = _reducer(mask, token_level_normalization, normalizer)
    loss = reduce(per_token)
    with torch.no_grad():
        num_tokens = int(mask.sum())
        low_clipped = (ratio < 1.0 - clip_ratio_low) & (advantage < 0) & kept
        high_clipped = (ratio > 1.0 + clip_ratio_high) & (advantage > 0) & kept
        token_mean = _reducer(mask, token_level_normalization=True, normalizer=None)
        behaviour = current if off_policy.mode == "none" else engine
        masked_ratio = torch.exp(current - behaviour)[mask]
        trainer_minus_engine = (current - engine)[mask]
        metrics = {
            "loss": float(loss),
            "pg_loss": float(reduce(pg_per_token)),
            "kl": float(reduce(kl_per_token)) if kl_per_token is not None else 0.0,
            "clip_fraction": float(token_mean((low_clipped | high_clipped).to(logprobs.dtype))),
            "importance_ratio/mean": float(masked_ratio.mean()) if num_tokens else 1.0,
            "importance_ratio/max": float(masked_ratio.max()) if num_tokens else 1.0,
            "approx_entropy": float(token_mean(-current)),
            "mismatch/k3_kl": float(_k3(trainer_minus_engine).mean()) if num_tokens else 0.0,
            "mismatch/large_delta_share": (
                float((trainer_minus_engine.abs() > LARGE_LOGPROB_DELTA).float().mean())
                if num_tokens
                else 0.0
            ),
            "num_tokens": float(num_tokens),
        }
        if agents is not None:
            metrics.update(agent_statistics(current, engine, mask, correction, agents))
    return loss, metrics


# A token whose probability the trainer and the engine put a factor of 2 or more apart.
LARGE_LOGPROB_DELTA = math.log(2.0)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per token `r - 1 - log r` with `r = p_trainer / p_engine` at the engine's sampled token:
    a non-negative, unbiased estimate of KL(engine || trainer), the train-inference mismatch
    (what router replay lowers for MoE models). In float64 with `expm1`: for the differences of
    a healthy run (1e-6) float32's `exp(x) - 1 - x` cancels to nothing."""
    wide = log_ratio.double()
    return torch.expm1(wide) - wide


@dataclass(frozen=True)
class Correction:
    """What an off-policy correction made of a batch: the log-ratio the PPO objective uses
    (`[B, T]`, with the gradient of `logprobs`), the tokens it keeps in the loss, and the tokens
    whose ratio it capped."""

    log_ratio: torch.Tensor
    kept: torch.Tensor
    capped: torch.Tensor


def correct_off_policy(
    current: torch.Tensor,
    engine: torch.Tensor,
    mask: torch.Tensor,
    config: OffPolicyCorrectionConfig,
) -> Correction:
    """Bound the importance ratio of every generated token as `config.mode` says (see
    :func:`grpo_loss`); `current` and `engine` are zero outside `mask`."""
    if config.mode == "none":
        return Correction(current - current.detach(), mask, torch.zeros_like(mask))
    log_ratio = current - engine
    judged = log_ratio.detach()  # what the decision looks at: the token's or the episode's
    if config.mode.startswith("sequence_"):
        count = mask.sum(dim=1, keepdim=True).clamp(min=1)
        episode = judged.sum(dim=1, keepdim=True) / count
        judged = torch.where(mask, episode.expand_as(judged), 0.0)
        log_ratio = log_ratio - log_ratio.detach() + judged
    log_high = math.log(config.ratio_high)
    if config.mode.endswith("_truncate"):
        # Truncation in log space: the value becomes min(r, cap) without overflowing, and the
        # gradient stays min(r, cap) * grad(logprobs) instead of vanishing above the cap.
        excess = (judged - log_high).clamp(min=0.0)
        return Correction(log_ratio - excess, mask, mask & (excess > 0))
    outside = (judged < math.log(config.ratio_low)) | (judged > log_high)
    return Correction(log_ratio, mask & ~outside, torch.zeros_like(mask))


# Per agent, what `agent_statistics` totals over rows, micro-batches and ranks: the maximum or
# minimum for these, the sum for the others; `finish_agent_statistics` turns the totals into the
# documented figures.
AGENT_STATISTICS_PREFIX = "by_agent/"
_MAX_STATISTICS = ("abs_diff_max", "ratio_max")
_MIN_STATISTICS = ("ratio_min",)


def agent_statistics(
    current: torch.Tensor,
    engine: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    agents: Sequence[str],
) -> dict[str, float]:
    """Per agent, totals of trainer-versus-engine figures over its generated tokens, as
    `by_agent/<agent>/<total>` floats that add up across micro-batches and ranks
    (:func:`merge_agent_statistics`). The ratio is the uncorrected token ratio; its deviations
    from 1 are summed rather than the ratio itself, so its spread survives float rounding."""
    diff = (current - engine).detach().double()
    ratio = torch.exp(diff)
    weights = mask.double()
    per_row = {
        "tokens": weights.sum(1),
        "masked": (mask & ~correction.kept).double().sum(1),
        "capped": correction.capped.double().sum(1),
        "abs_diff": (diff.abs() * weights).sum(1),
        "ratio_dev": ((ratio - 1) * weights).sum(1),
        "ratio_dev_sq": ((ratio - 1).square() * weights).sum(1),
        "abs_diff_max": torch.where(mask, diff.abs(), 0.0).amax(1),
        "ratio_max": torch.where(mask, ratio, -math.inf).amax(1),
        "ratio_min": torch.where(mask, ratio, math.inf).amin(1),
    }
    columns = {name: values.tolist() for name, values in per_row.items()}
    rows = [
        {
            f"{AGENT_STATISTICS_PREFIX}{agent}/{name}": column[row]
            for name, column in columns.items()
        }
        for row, agent in enumerate(agents)
        if columns["tokens"][row] > 0
    ]
    return merge_agent_statistics(rows)


def merge_agent_statistics(reports: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The `by_agent/...` totals of several reports (rows, micro-batches or ranks) combined."""
    merged: dict[str, float] = {}
    for report in reports:
        for key, value in report.items():
            if not key.startswith(AGENT_STATISTICS_PREFIX):
                continue
            total = key.rsplit("/", 1)[1]
            if key not in merged:
                merged[key] = value
            elif total in _MAX_STATISTICS:
                merged[key] = max(merged[key], value)
            elif total in _MIN_STATISTICS:
                merged[key] = min(merged[key], value)
            else:
                merged[key] += value
    return merged


def finish_agent_statistics(totals: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per agent, the documented figures of its `by_agent/...` totals: `masked_share`,
    `capped_share`, `logprob_diff/mean|max` (|trainer - engine| per token) and
    `ratio/mean|std|min|max` (the uncorrected token ratio)."""
    by_agent: dict[str, dict[str, float]] = {}
    for key, value in totals.items():
        if key.startswith(AGENT_STATISTICS_PREFIX):
            agent, total = key[len(AGENT_STATISTICS_PREFIX) :].rsplit("/", 1)
            by_agent.setdefault(agent, {})[total] = value
    figures = {}
    for agent, total in by_agent.items():
        tokens = total["tokens"]
        deviation = total["ratio_dev"] / tokens
        variance = max(total["ratio_dev_sq"] / tokens - deviation**2, 0.0)
        figures[agent] = {
            "masked_share": total["masked"] / tokens,
            "capped_share": total["capped"] / tokens,
            "logprob_diff/mean": total["abs_diff"] / tokens,
            "logprob_diff/max": total["abs_diff_max"],
            "ratio/mean": 1.0 + deviation,
            "ratio/std": math.sqrt(variance),
            "ratio/min": total["ratio_min"],
            "ratio/max": total["ratio_max"],
        }
    return figures


def _reducer(mask: torch.Tensor, token_level_normalization: bool, normalizer: float | None):
    """A function reducing a `[B, T]` per-token tensor to a scalar over the masked tokens."""
    if token_level_normalization:
        denominator = float(mask.sum()) if normalizer is None else normalizer

        def reduce(values: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, values, 0.0).sum() / max(denominator, 1.0)

        return reduce
    tokens_per_sequence = mask.sum(dim=1)
    has_tokens = tokens_per_sequence > 0
    denominator = float(has_tokens.sum()) if normalizer is None else normalizer

    def reduce(values: torch.Tensor) -> torch.Tensor:
        per_sequence = torch.where(mask, values, 0.0).sum(dim=1) / tokens_per_sequence.clamp(min=1)
        return per_sequence.sum() / max(denominator, 1.0)

    return reduce


def _check_shapes(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    reference_logprobs: torch.Tensor | None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {list(logprobs.shape)}")
    named = {"generation_logprobs": generation_logprobs, "loss_mask": loss_mask}
    if reference_logprobs is not None:
        named["reference_logprobs"] = reference_logprobs
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {list(tensor.shape)}, expected {list(logprobs.shape)} "
                "(the shape of logprobs)"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = [{logprobs.shape[0]}] (one per sequence), "
            f"got {list(advantages.shape)}"
        )
