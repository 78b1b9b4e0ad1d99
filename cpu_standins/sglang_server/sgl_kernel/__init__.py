"""Stand-in for the `sgl_kernel` CPU extension: the one op the real SGLang 0.5.23 server runs on a
CPU when no CPU build of sgl-kernel is installed (`cpu_standins/README.md`).

SGLang on a CPU (`--device cpu`) imports `assign_req_to_token_pool_cpu` from `sgl_kernel` at
start-up (`sglang/srt/mem_cache/allocation.py`) and calls it for every batch. It imports other
`*_cpu` ops at start-up too (speculative decoding's, KV moves between slots), for paths these
servers never take; here each of those refuses when called. The PyPI `sglang-kernel` wheel carries
CUDA ops only. Everything else takes SGLang's torch-native paths because this module registers no
`torch.ops.sgl_kernel.convert_weight_packed` (`cpu_has_amx_support()` is then false).
`generation=sglang_cpu` (the CPU experiments and the tests that start a real server) puts this
folder on the server's PYTHONPATH; a server on a GPU, or with sgl-kernel's own CPU build, never
sees it.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Request `i` owns row `req_pool_indices[i]` of `req_to_token` (`pool_len` columns); its
    positions `start_offset[i]:end_offset[i]` receive the next `end - start` entries of
    `out_cache_loc`, which holds the batch's new slots request after request (the contract of
    the Triton kernel `assign_req_to_token_pool` it replaces on a CPU).
    """
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"slots {start}:{end} outside a request row of {pool_len} tokens")
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


def __getattr__(name: str):
    """Every other CPU op SGLang imports at start-up (speculative decoding's tree kernels, KV
    moves between slots, ...) belongs to a path these servers never take: it refuses if called.
    """
    if not name.endswith("_cpu"):
        raise AttributeError(f"module 'sgl_kernel' (the CPU stand-in) has no attribute {name!r}")

    def refuse(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"the sgl_kernel CPU stand-in (cpu_standins/sglang_server) has no {name}: the CPU "
            "servers it is made for never take the SGLang path that needs it"
        )

    return refuse
