"""Per-token log-probabilities from Megatron's vocabulary-parallel logits, without gathering the
vocabulary; under context parallelism, reassembled into whole sequences."""

from __future__ import annotations

from typing import Any

import torch

from gymrl.trainer.megatron.batches import context_parallel_unshard


def token_logprobs(
    parallel_state: Any,
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
) -> torch.Tensor:
    """`[B, S]` log-probabilities aligned with `input_ids` (position t: token t, position 0 is 0).

    `logits` are this TP rank's vocabulary slice at this CP rank's positions, `labels` the next
    token at those positions. Logits are divided by the sampler's temperature first: generation
    log-probabilities are those of the temperature-scaled distribution.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ps = parallel_state
    scaled = logits.float() / temperature
    # Megatron may pad the vocabulary for TP divisibility; padded entries must get no mass.
    local_vocab = scaled.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local_vocab
    if start + local_vocab > vocab_size:
        padded = torch.arange(start, start + local_vocab, device=scaled.device)
        scaled = scaled.masked_fill(padded >= vocab_size, float("-inf"))
    next_token = -vocab_parallel_cross_entropy(scaled, labels)
    if ps.get_context_parallel_world_size() > 1:
        from torch.distributed.nn.functional import all_gather

        shards = all_gather(next_token.contiguous(), group=ps.get_context_parallel_group())
        next_token = context_parallel_unshard(shards)
    first = next_token.new_zeros(next_token.shape[0], 1)
    return torch.cat([first, next_token[:, :-1]], dim=1)
