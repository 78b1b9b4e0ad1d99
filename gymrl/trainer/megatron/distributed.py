"""The torch.distributed environment of a trainer rank: set by the group, read by the worker."""

from __future__ import annotations

import os
from datetime import timedelta

DIST_TIMEOUT = timedelta(minutes=30)
DIST_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def distributed_env(
    rank: int, world_size: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """Environment of one trainer actor. Ray gives each actor exactly one GPU through
    `CUDA_VISIBLE_DEVICES`, so its local rank is always 0."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
    }


def local_rank_from_env() -> int:
    """LOCAL_RANK, after checking that `init_process_group("nccl")` has its whole env."""
    missing = [key for key in DIST_ENV_KEYS if key not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed environment variables {missing} are not set; start trainer "
            "ranks with MegatronTrainerGroup (or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, "
            "LOCAL_RANK yourself)"
        )
    return int(os.environ["LOCAL_RANK"])
