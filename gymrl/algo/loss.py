"""The GRPO policy loss: a clipped, importance-corrected policy gradient with an optional KL term.

In async GRPO the samples come from a behaviour policy, the sampler's weights, which can be
several versions older than the trainer's, and is in any case computed by a different engine
(other kernels, other precision). The importance ratio `pi_theta / pi_behaviour` (from the
sampler's own log-probabilities) corrects for that; PPO-style clipping keeps one update from
moving a token's probability far from the behaviour policy; a cap truncates the ratio (truncated
importance sampling) so that a few tokens the sampler found very unlikely cannot dominate the
gradient. Tensors follow the alignment of `gymrl.algo.trajectory`: `[B, T]`, position `t`
describing token `t`.
"""

from __future__ import annotations

import math

import torch

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
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    predicts = torch.zeros_like(loss_mask, dtype=torch.bool)
    predicts[:, 1:] = loss_mask[:, 1:].bool()
    selected = predicts[:, 1:]
    logits = output_layer(hidden_states[:, :-1][selected]).float()
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
    importance_sampling_correction: bool,
    importance_ratio_cap: float | None,
    token_level_normalization: bool,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss `-min(r A, clip(r, 1 - low, 1 + high) A) + kl_coef * k3`, reduced over
    the masked tokens; returns `(loss, metrics)`.

    * `r`: with `importance_sampling_correction`, `exp(logprobs - generation_logprobs)`, truncated
      at `importance_ratio_cap` when given (its value is capped, its gradient scaled down with it,
      not zeroed); without it, `exp(logprobs - logprobs.detach())`, which is 1 with the gradient
      of the plain policy gradient (valid only when the samples are on-policy).
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
    the clip removed), `importance_ratio/mean` and `importance_ratio/max` (of the uncapped
    ratio), `approx_entropy` (mean negative log-probability of the sampled tokens; an entropy
    estimate when the samples are near on-policy) and `num_tokens`.
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
    if importance_ratio_cap is not None and importance_ratio_cap <= 0:
        raise ValueError(f"importance_ratio_cap must be > 0 or None, got {importance_ratio_cap}")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (a token or sequence count), got {normalizer}")

    mask = loss_mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Zero the masked-out positions before any exp so that padding garbage cannot become inf/NaN.
    current = torch.where(mask, logprobs, zeros)
    behaviour = (
        torch.where(mask, generation_logprobs.to(logprobs.dtype), zeros)
        if importance_sampling_correction
        else current.detach()
    )
    log_ratio = current - behaviour
    if importance_ratio_cap is not None:
        # Truncation in log space: the value becomes min(r, cap) without overflowing, and the
        # gradient stays min(r, cap) * grad(logprobs) instead of vanishing above the cap.
        excess = (log_ratio.detach() - math.log(importance_ratio_cap)).clamp(min=0.0)
        log_ratio = log_ratio - excess
    ratio = torch.exp(log_ratio)
    advantage = advantages.to(logprobs.dtype).unsqueeze(-1).expand_as(logprobs)
    clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_per_token = -torch.minimum(ratio * advantage, clipped * advantage)
    per_token = pg_per_token
    kl_per_token = None
    if reference_logprobs is not None:
        log_ref_over_policy = (
            torch.where(mask, reference_logprobs.to(logprobs.dtype), zeros) - current
        )
        kl_per_token = torch.exp(log_ref_over_policy) - log_ref_over_policy - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl_per_token

    reduce = _reducer(mask, token_level_normalization, normalizer)
    loss = reduce(per_token)
    with torch.no_grad():
        num_tokens = int(mask.sum())
        low_clipped = (ratio < 1.0 - clip_ratio_low) & (advantage < 0)
        high_clipped = (ratio > 1.0 + clip_ratio_high) & (advantage > 0)
        token_mean = _reducer(mask, token_level_normalization=True, normalizer=None)
        masked_ratio = torch.exp(current - behaviour)[mask]
        metrics = {
            "loss": float(loss),
            "pg_loss": float(reduce(pg_per_token)),
            "kl": float(reduce(kl_per_token)) if kl_per_token is not None else 0.0,
            "clip_fraction": float(token_mean((low_clipped | high_clipped).to(logprobs.dtype))),
            "importance_ratio/mean": float(masked_ratio.mean()) if num_tokens else 1.0,
            "importance_ratio/max": float(masked_ratio.max()) if num_tokens else 1.0,
            "approx_entropy": float(token_mean(-current)),
            "num_tokens": float(num_tokens),
        }
    return loss, metrics


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
