"""The Megatron save's manifest: each rank hashes its own shards and rank 0 gathers them, over a
real two-process gloo group on the CPU (the save itself needs Megatron and a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed
import torch.multiprocessing

from gymrl.run.checkpoint import (
    MANIFEST_FILE,
    TrainerState,
    hash_files,
    latest_verified_checkpoint,
)
from gymrl.trainer.megatron.checkpointing import MEGATRON_CKPT_DIR, gather_shard_hashes


def _rank(rank: int, world_size: int, staging: str, store: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    try:
        folder = Path(staging)
        shards = folder / MEGATRON_CKPT_DIR
        (shards / f"__{rank}_0.distcp").write_bytes(f"shard of rank {rank}".encode() * 1000)
        if rank == 0:
            (shards / ".metadata").write_bytes(b"written by rank 0 alone")
        hashed = gather_shard_hashes(folder)
        if rank == 0:
            names = [f"{MEGATRON_CKPT_DIR}/__{r}_0.distcp" for r in range(world_size)]
            assert hashed == hash_files(folder, names)
            TrainerState(3, 3, {}, [{} for _ in range(world_size)]).write(folder, hashed)
        else:
            assert hashed == {}
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_hashes_its_shards_and_rank_0_writes_one_manifest(tmp_path):
    checkpoint = tmp_path / "step_3"
    (checkpoint / MEGATRON_CKPT_DIR).mkdir(parents=True)
    torch.multiprocessing.spawn(
        _rank, args=(2, str(checkpoint), str(tmp_path / "store")), nprocs=2, join=True
    )
    files = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == [
        "gymrl_state.json",
        "megatron/.metadata",
        "megatron/__0_0.distcp",
        "megatron/__1_0.distcp",
    ]
    assert latest_verified_checkpoint(tmp_path) == (checkpoint, [])
