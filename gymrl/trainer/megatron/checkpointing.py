"""Checkpoints and the Hugging Face export of the Megatron trainer (collective: every rank calls).

The folder layout and the resume state are `gymrl.run.checkpoint`'s, shared with the torch trainer;
the weights and the distributed optimizer's state are a Megatron distributed checkpoint under
`megatron/`. With `trainer.lora` the model's part of it is the adapter alone (the base weights are
the policy's, unchanged, as PEFT saves), and rank 0 also writes the adapter in PEFT's format
(`adapter_config.json`, `adapter_model.safetensors`) beside it: what evaluation, the merge command
and any PEFT tool read, as from a torch LoRA run. A resume loads the distributed checkpoint, which
holds the same adapter values next to the optimizer state sharded as the ranks hold it.

Rank 0 creates the staging folder, every rank writes its shards into it and hashes
them for the manifest (:func:`gather_shard_hashes`), rank 0 writes the state, the manifest and the
marker and renames it into place (`gymrl.run.atomic`); barriers separate the phases.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gymrl.run.adapter import ADAPTER_CONFIG_FILE, AdapterWeights
from gymrl.run.atomic import begin, publish, staging_folder
from gymrl.run.checkpoint import (
    TrainerState,
    check_adapter_shape,
    check_keep_last,
    hash_files,
    prune_checkpoints,
    remove_leftover_staging,
)

MEGATRON_CKPT_DIR = "megatron"


def save_distributed_checkpoint(
    directory: str | os.PathLike[str],
    model: list[Any],
    optimizer: Any,
    state: TrainerState,
    *,
    keep_last: int,
    adapter: AdapterWeights | None = None,
) -> str:
    """Write `directory/step_<step>/` (collective) and keep the newest `keep_last`. With
    `adapter` (a LoRA run's, exported on every rank), the model's part is the adapter alone and
    rank 0 writes `adapter` in PEFT's format too."""
    from megatron.core import dist_checkpointing

    check_keep_last(keep_last)
    root = Path(directory)
    target = root / f"step_{state.step}"
    rank = torch.distributed.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftover_staging(root)
        (begin(target) / MEGATRON_CKPT_DIR).mkdir()
    torch.distributed.barrier()
    staging = staging_folder(target)
    dist_checkpointing.save(
        _sharded_state_dict(model, optimizer, is_loading=False, adapter_only=adapter is not None),
        str(staging / MEGATRON_CKPT_DIR),
    )
    hashed = gather_shard_hashes(staging)
    if rank == 0:
        if adapter is not None:
            adapter.write(staging)
        state.write(staging, hashed)
        publish(staging, target, durable=True)
        prune_checkpoints(root, keep_last)
    torch.distributed.barrier()
    return str(target)


def gather_shard_hashes(staging: Path) -> dict[str, dict[str, Any]]:
    """Manifest entries of every rank's shards, on rank 0 (empty on the others); collective.

    Each rank hashes the shard files it wrote, while they are likely still in its page cache and
    in parallel with the other ranks, instead of rank 0 reading the whole checkpoint back alone.
    torch.distributed.checkpoint names a rank's shards `__<rank>_<n>.distcp`; any other file
    (the metadata, Megatron's common state) is left to rank 0's manifest, which hashes whatever
    no rank reported. The gather doubles as the barrier after the save.
    """
    rank = torch.distributed.get_rank()
    shards = sorted((staging / MEGATRON_CKPT_DIR).glob(f"__{rank}_*.distcp"))
    own = hash_files(staging, [shard.relative_to(staging).as_posix() for shard in shards])
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.gather_object(own, gathered if rank == 0 else None, dst=0)
    return {name: entry for entries in gathered if entries for name, entry in entries.items()}


def load_distributed_checkpoint(
    path: str | os.PathLike[str],
    model: list[Any],
    optimizer: Any,
    *,
    adapter_config: dict[str, Any] | None = None,
) -> TrainerState:
    """Restore model and optimizer from a complete checkpoint (collective); return its state.
    `adapter_config` (PEFT's fields of a LoRA run's adapter, None: full training) must match
    the checkpoint's: a full checkpoint into a LoRA run, or an adapter of another rank or target
    set, is refused naming the field before anything loads."""
    from megatron.core import dist_checkpointing

    folder = Path(path)
    state = TrainerState.read(folder)
    has_adapter = (folder / ADAPTER_CONFIG_FILE).is_file()
    if has_adapter != (adapter_config is not None):
        held, trains = ("an adapter", "every weight") if has_adapter else ("every weight", "LoRA")
        raise ValueError(
            f"{folder} holds {held} and this trainer trains {trains}: resume it with "
            f"trainer.lora.enabled={str(has_adapter).lower()} (and the adapter's shape)"
        )
    if adapter_config is not None:
        check_adapter_shape(folder, AdapterWeights.read(folder).config, adapter_config)
    loaded = dist_checkpointing.load(
        _sharded_state_dict(
            model, optimizer, is_loading=True, adapter_only=adapter_config is not None
        ),
        str(folder / MEGATRON_CKPT_DIR),
    )
    # Copies into parameters that require grad (the optimizer's fp32 main params among them).
    with torch.no_grad():
        if adapter_config is None:
            unwrap(model[0]).load_state_dict(loaded["model"])
        else:
            _load_adapter_state(unwrap(model[0]), loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer)
    return state


def _load_adapter_state(module: Any, adapter_state: dict[str, Any]) -> None:
    """Load a LoRA checkpoint's adapter into `module`: every adapter parameter must be in it,
    and it holds nothing else (the base weights are the policy's, loaded at construction)."""
    result = module.load_state_dict(adapter_state, strict=False)
    missing = [key for key in result.missing_keys if _ADAPTER_KEY in key]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint's adapter does not fit the model: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}; resume with trainer.lora set as "
            "the run that saved it"
        )


def restore_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam step count again, the one its group was saved with.

    With torch's Adam (no Transformer Engine or Apex), megatron-core 0.19's distributed optimizer
    loads the step into the group, then hands one shared step tensor to every parameter and
    refills it from the live optimizer while loading the `dp_reshardable` state: the resumed
    step count is the live one, not the saved one, and torch's Adam then adds 1 to the shared
    tensor once per parameter each step (wrong bias correction from the first resumed step).
    Transformer Engine's fused Adam keeps the step in the group alone; nothing to do there.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                saved = inner.state.get(param, {}).get("step")
                if isinstance(saved, torch.Tensor):
                    inner.state[param]["step"] = torch.full_like(saved, float(group["step"]))


def export_hf_checkpoint(bridge: Any, model: list[Any], directory: str | os.PathLike[str]) -> str:
    """Write a Hugging Face checkpoint to `directory` (collective; staged and renamed, so a
    reader never sees a partial checkpoint)."""
    target = Path(directory)
    rank = torch.distributed.get_rank()
    if rank == 0:
        begin(target)
    torch.distributed.barrier()
    staging = staging_folder(target)
    bridge.save_hf_pretrained(model, staging, show_progress=False)
    torch.distributed.barrier()
    if rank == 0:
        publish(staging, target, durable=False)
    torch.distributed.barrier()
    return str(target)


# The distributed optimizer's state as one tensor per DP buffer: every rank saves and loads its
# own shard with no gather (resume needs the same TP/PP/EP layout; DP may change). Megatron's
# default without metadata is a deprecated format that current megatron-core refuses.
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


# What megatron-bridge's LoRA names its adapters' parameters and state (`LoRALinear.adapter`),
# the filter its own PEFT checkpoints use (`PEFT.adapter_key_filter`).
_ADAPTER_KEY = ".adapter."


def _sharded_state_dict(
    model: list[Any], optimizer: Any, *, is_loading: bool, adapter_only: bool
) -> dict[str, Any]:
    if len(model) != 1:
        raise RuntimeError("checkpointing supports one model chunk (no virtual pipeline)")
    model_state = unwrap(model[0]).sharded_state_dict(prefix="", metadata=_SHARDING_METADATA)
    saved_model = (
        {key: value for key, value in model_state.items() if _ADAPTER_KEY in key}
        if adapter_only
        else model_state
    )
    return {
        "model": saved_model,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_SHARDING_METADATA
        ),
    }


def unwrap(chunk: Any) -> Any:
    """The `GPTModel` inside Megatron's DDP and mixed-precision wrappers."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, DistributedDataParallel | Float16Module):
        chunk = chunk.module
    return chunk
