"""Mixed precision for the torch backends: the transformer's matmuls in bfloat16 where the
hardware runs them natively, everything that decides a probability in float32.

Weights, gradients and the optimizer state stay in `policy.dtype`; only the transformer body runs
under `torch.autocast`. The output layer and the log-softmax run in float32 outside it, in the
trainer and in the generation engine alike, so the log-probabilities the sampler reports and the
ones the trainer recomputes differ only by the body's rounding, not by a bfloat16 vocabulary
projection. On CPUs with AMX (Xeon Sapphire Rapids and later) this made SmolLM2-135M's training
step 2.4x faster and its decoding 2x faster (benchmarks/README.md, "Mixed precision").
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ComputeDtype = Literal["auto", "float32", "bfloat16"]


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware (not by emulation)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return False


def resolve_compute_dtype(choice: ComputeDtype, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `policy.compute_dtype` on `device`; None = no autocast."""
    if choice == "bfloat16" or (choice == "auto" and native_bfloat16(device)):
        return torch.bfloat16
    return None


def round_body_matmul_weights(model: PreTrainedModel, dtype: torch.dtype | None) -> None:
    """Store the Linear weights of `model`'s transformer body in `dtype`, for inference under
    `body_autocast(device, dtype)`.

    Autocast rounds every float32 weight to `dtype` again on every forward: for a decoder that is
    the whole body once per generated token (SmolLM2-135M at batch 16 on 2 CPU cores: 117 ms per
    decode step, 70 ms with the weights stored rounded; benchmarks/README.md). Rounding them once
    gives the matmuls the very same operands. Embeddings, norms and the output layer keep their
    dtype, so the residual stream and the logits stay as the trainer computes them. A no-op for
    `dtype` None (no autocast)."""
    if dtype is None:
        return
    for module in model.base_model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(dtype)


def body_autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """Autocast for the transformer body (a no-op for `dtype` None)."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)
