"""How new weights reach the engines: the three refit transports, and the one place a
`WeightSender` is made.

* **object store** (the torch engine): the trainer's state dict goes through Ray's object store to
  the generation server, which loads it into its engine (an SGLang engine behind a torch trainer
  writes it to shared disk itself, `SGLangEngine.update_weights`);
* **broadcast** (`generation.refit.transport: nccl`): the generation server pauses its SGLang
  engines, the trainer's rank 0 sends the weights over a process group
  (`gymrl.generation.sglang.weight_sync`), the engines continue under the new version;
* **disk** (`transport: disk`): the trainer exports a Hugging Face checkpoint to shared storage,
  every server loads it, and the previous version is deleted once all have.

A failure of any of them leaves the engines paused and raises: a run with servers on mixed
weights must stop, not train on them. The trainer role (`gymrl.roles.trainer`) picks the
transport; the trainer process calls :func:`weight_sender`.

Where the weights are checked (`generation.refit.verify_weights`): with `verify_method:
weights_checker` on the generation side, by the SGLang engine's `begin_refit` and `end_refit`,
which both SGLang transports pass through (`gymrl.generation.sglang.refit_checks.weights_checker`);
with `read_back` on the trainer side, by the `WeightSender` after a broadcast
(`gymrl.generation.sglang.refit_checks.read_back`).
The torch engine loads the state dict itself and needs neither.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gymrl.config.schema.generation import RefitConfig
from gymrl.generation.sglang.engine import remove_loaded_refits
from gymrl.generation.sglang.refit_checks.read_back import ReadBackCheck
from gymrl.generation.sglang.weight_sync import Backend, WeightSender
from gymrl.model.policy import DTYPES

Wait = Callable[[Any, str], Any]


def broadcast_backend(device: torch.device | str) -> Backend:
    """The weight-update group's backend for weights the trainer holds on `device`: NCCL from a
    GPU, gloo from the CPU (a trainer without CUDA: the CPU tests, the Megatron CPU shim)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def weight_sender(
    urls: list[str],
    tp_sizes: list[int],
    refit: RefitConfig,
    *,
    master_address: str,
    backend: Backend,
    served_dtype: str,
) -> WeightSender:
    """The trainer's rank 0 end of a broadcast refit, with the read-back check when the config
    asks for it (`verify_method: read_back`); `served_dtype` is the servers' (`policy.dtype`),
    which sampled weights are compared in."""
    check = (
        ReadBackCheck(
            every=refit.verify_every,
            rows=refit.verify_rows,
            served_dtype=DTYPES[served_dtype],
            timeout_s=refit.timeout_s,
        )
        if refit.verify_weights and refit.verify_method == "read_back"
        else None
    )
    return WeightSender(
        urls,
        tp_sizes,
        master_address=master_address,
        backend=backend,
        bucket_bytes=refit.bucket_bytes,
        timeout_s=refit.timeout_s,
        check=check,
    )


def refit_through_object_store(generation: Any, version: int, weights: Any, wait: Wait) -> None:
    """`weights`: an object-store reference to the trainer's state dict (never fetched here)."""
    wait(generation.update_weights.remote(weights, version), "the engine refit")


def refit_by_broadcast(
    generation: Any, version: int, send: Callable[[list[str], list[int]], Any], wait: Wait
) -> None:
    """Pause the SGLang servers for `version`, have the trainer's rank 0 `send` the weights to
    their URLs, continue under `version`."""
    wait(generation.begin_refit.remote(version), "pausing the SGLang servers")
    urls, tp_sizes = wait(generation.weight_sync_targets.remote(), "the SGLang server URLs")
    send(urls, tp_sizes)
    wait(generation.end_refit.remote(version), "resuming the SGLang servers")


def refit_from_disk(
    generation: Any,
    version: int,
    export_checkpoint: Callable[[Path], str],
    refit_dir: Path,
    wait: Wait,
) -> None:
    """Export a Hugging Face checkpoint under `refit_dir`, load it on every server, then delete
    every older version."""
    path = export_checkpoint(refit_dir / f"v{version}")
    wait(generation.refit_from_disk.remote(path, version), "the SGLang refit")
    remove_loaded_refits(refit_dir, keep=path)  # every server has loaded `path`
