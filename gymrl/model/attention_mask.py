"""Custom attention masks for Hugging Face models: packed sequences, prefix trees.

transformers passes a 4D mask through untouched (`masking_utils`: "already prepared, or custom")
to eager and SDPA attention alike, as long as it is additive: 0 where a query may attend to a
key, the dtype's lowest value where it may not (a boolean mask would reach eager attention as
ones and zeros to add). The generation engine's packed prefill and the trainer's prefix-tree
packing both build theirs here.
"""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`allowed` (booleans, `[batch, 1, queries, keys]`) as a float mask of `dtype`."""
    blocked = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, blocked
    )
