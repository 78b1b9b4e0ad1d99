"""Micro-batches of one step on every data-parallel rank, and Megatron's context-parallel layout:
pure functions on CPU tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gymrl.algo.trajectory import Trajectory, collate

PAD_TOKEN_ID = 0  # any valid id: padding sits after every real token and is masked out
_FILLER = Trajectory(
    token_ids=[PAD_TOKEN_ID],
    loss_mask=[0],
    generation_logprobs=[0.0],
    reward=0.0,
    agent="",
    group_id="filler",
    weight_version=0,
)


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one micro-batch (indices into the step's trajectories; None = a filler row that
    trains on nothing) and the padded sequence length."""

    indices: tuple[int | None, ...]
    seq_length: int


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    data_parallel_size: int,
    micro_batch_size: int,
    sequence_multiple: int,
    uniform_shapes: bool,
) -> list[list[MicroBatch]]:
    """Micro-batches of every data-parallel rank (outer list indexed by DP rank).

    Zero-length (masked) trajectories are left out. Every rank gets the same number of
    micro-batches. With `uniform_shapes` (pipeline parallelism) every micro-batch has
    `micro_batch_size` rows and the step's longest padded length; otherwise rows are grouped by
    length and each micro-batch is padded to its own longest row.
    """
    if data_parallel_size < 1 or micro_batch_size < 1 or sequence_multiple < 1:
        raise ValueError(
            f"data_parallel_size={data_parallel_size}, micro_batch_size={micro_batch_size} and "
            f"sequence_multiple={sequence_multiple} must all be >= 1"
        )
    kept = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(data_parallel_size)]
    for position, index in enumerate(kept):
        lap, offset = divmod(position, data_parallel_size)
        rank = offset if lap % 2 == 0 else data_parallel_size - 1 - offset
        per_rank[rank].append(index)
    count = max(1, math.ceil(max(len(rows) for rows in per_rank) / micro_batch_size))
    longest = _round_up(max((lengths[i] for i in kept), default=1), sequence_multiple)
    plans = []
    for rows in per_rank:
        plan = []
        for start in range(0, count * micro_batch_size, micro_batch_size):
            chunk: list[int | None] = list(rows[start : start + micro_batch_size])
            if uniform_shapes:
                chunk += [None] * (micro_batch_size - len(chunk))
                plan.append(MicroBatch(tuple(chunk), longest))
                continue
            if not chunk:
                chunk = [None]
            own = max((lengths[i] for i in chunk if i is not None), default=1)
            plan.append(MicroBatch(tuple(chunk), _round_up(own, sequence_multiple)))
        plans.append(plan)
    return plans


def build_micro_batch(
    trajectories: Sequence[Trajectory], advantages: torch.Tensor, micro_batch: MicroBatch
) -> dict[str, torch.Tensor]:
    """The CPU tensors of one micro-batch: `gymrl.algo.trajectory.collate` padded to its length,
    plus `labels` (the next token at each position, padding at the end) and `position_ids`."""
    rows = [_FILLER if i is None else trajectories[i] for i in micro_batch.indices]
    row_advantages = torch.tensor(
        [0.0 if i is None else float(advantages[i]) for i in micro_batch.indices]
    )
    batch = collate(
        rows,
        advantages=row_advantages,
        pad_token_id=PAD_TOKEN_ID,
        max_length=micro_batch.seq_length,
    )
    labels = torch.full_like(batch["input_ids"], PAD_TOKEN_ID)
    labels[:, :-1] = batch["input_ids"][:, 1:]
    batch["labels"] = labels
    batch["position_ids"] = torch.arange(micro_batch.seq_length).expand_as(labels).contiguous()
    routes = micro_batch_routes(rows, micro_batch.seq_length)
    if routes is not None:
        batch["routed_experts"] = routes
    return batch


def micro_batch_routes(rows: Sequence[Trajectory], seq_length: int) -> torch.Tensor | None:
    """Router replay: the rows' routed experts `[B, seq_length, layers, top-k]`, -1 where none
    arrived (the trajectory's missing id, padding, filler rows); None when no row has routes.
    int16 holds every expert id of a uint8 layout (up to 254) at a quarter of int64's bytes."""
    routed = [row.routed_experts for row in rows if row.routed_experts is not None]
    if not routed:
        return None
    _, layers, top_k = routed[0].shape
    wide = any(routes.dtype.itemsize > 1 for routes in routed)
    dtype = np.int32 if wide else np.int16
    out = np.full((len(rows), seq_length, layers, top_k), -1, dtype=dtype)
    for index, row in enumerate(rows):
        routes = row.routed_experts
        if routes is None:
            continue
        present = routes != np.iinfo(routes.dtype).max
        out[index, : len(routes)][present] = routes[present]
    return torch.from_numpy(out)


# ----------------------------------------------------------------------- context parallelism
def context_parallel_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of a sequence held by CP rank `cp_rank` in Megatron's load-balanced layout.

    The sequence is cut into `2 x cp_size` equal chunks; rank `r` holds chunks `r` and
    `2 x cp_size - 1 - r`, so each rank has an equal share of the causal attention work.
    """
    if cp_size == 1:
        return torch.arange(seq_length)
    if seq_length % (2 * cp_size):
        raise ValueError(f"seq_length={seq_length} is not a multiple of 2 x CP = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk),
            torch.arange(second * chunk, (second + 1) * chunk),
        ]
    )


def context_parallel_unshard(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of the layout above along dim 1: `shards[r]` is rank r's `[B, S / CP]` piece."""
    cp_size = len(shards)
    seq_length = sum(shard.shape[1] for shard in shards)
    order = torch.cat([context_parallel_positions(seq_length, cp_size, r) for r in range(cp_size)])
    gathered = torch.cat(list(shards), dim=1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_length)
    return gathered.index_select(1, inverse.to(gathered.device))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
